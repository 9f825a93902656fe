"""Trainer integrations: Hugging Face ``transformers`` (:mod:`gearsam_fused.integrations.transformers`).

Each module imports its framework when it is imported itself, never before: ``pip install gearsam_fused[transformers]``
provides it.
"""
