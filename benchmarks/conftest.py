"""pytest-benchmark settings shared by the benchmarks: every saved result says where and when it was measured."""

import datetime
import os
import platform

import torch

if not torch.cuda.is_available():
    # lets the triton backend run on CPU tensors (slowly) if a benchmark asks for it explicitly
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["date"] = datetime.date.today().isoformat()
    machine_info["torch"] = torch.__version__
    machine_info["cpu_count"] = os.cpu_count()
    machine_info["platform"] = platform.platform()
    if torch.cuda.is_available():
        machine_info["gpu"] = torch.cuda.get_device_name()
        machine_info["cuda"] = torch.version.cuda
    else:
        machine_info["gpu"] = None
    try:
        import triton

        machine_info["triton"] = triton.__version__
    except ImportError:
        machine_info["triton"] = None
