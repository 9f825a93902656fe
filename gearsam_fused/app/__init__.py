"""The application behind the ``gearsam`` command (also ``python -m gearsam_fused``): the demo, training runs and
their run directories, plots, block tables and the benchmark launcher.

It uses the library as any user does, through its public API; nothing in the library imports it, so
``import gearsam_fused`` never loads the training loop, its datasets or matplotlib.
"""
