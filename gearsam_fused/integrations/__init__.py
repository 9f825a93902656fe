"""Trainer integrations: Hugging Face ``transformers`` (:mod:`gearsam_fused.integrations.transformers`) and Lightning
(:mod:`gearsam_fused.integrations.lightning`).

Each module imports its framework when it is imported itself, never before: the extras ``gearsam_fused[transformers]``
and ``gearsam_fused[lightning]`` provide them.
"""
