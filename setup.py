"""Install gearsam_fused.

Install PyTorch first (its CPU or CUDA build, as you need), then this package without build isolation so the build
uses that torch instead of downloading another one:

    pip install torch ninja
    pip install --no-build-isolation -e ".[test]"

``triton_kernels/`` is installed as ``gearsam_fused.triton_kernels``: a top-level module of that name belongs to a
different distribution.

The C++/CUDA extension ``gearsam_fused._C`` (sources in ``csrc/``, the ``cpp`` backend) is built with ninja when a
C++ compiler is found; its CUDA kernels are added when torch is a CUDA build and nvcc is found. Switches, each
``auto`` (the default: build what can be built, warn about the rest), ``1`` (build it or fail) or ``0`` (skip it):

    GEARSAM_BUILD_CPP    the extension as a whole
    GEARSAM_BUILD_CUDA   its CUDA kernels

and:

    GEARSAM_DEBUG        ``1`` keeps the debug information (``-g``, as Python's own flags ask); the default, ``0``,
                         compiles the C++ with ``-g0`` and links with ``-Wl,--strip-debug`` on Linux (the symbol
                         table stays, so backtraces and profiles name the functions)
    TORCH_CUDA_ARCH_LIST GPU architectures to compile for (default "8.0;9.0+PTX")

Without the extension the install still works; ``backend="cpp"`` then says how to build it. A wheel built without it
(skipped, or its build failed) is pure Python, tagged ``py3-none-any``.
"""

import contextlib
import glob
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import warnings

from setuptools import setup

try:
    from setuptools.command.bdist_wheel import bdist_wheel  # setuptools >= 70.1
except ImportError:
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        bdist_wheel = None  # no wheels to tag

PACKAGES = [
    "gearsam_fused", "gearsam_fused.app", "gearsam_fused.backends", "gearsam_fused.integrations",
    "gearsam_fused.models", "gearsam_fused.triton_kernels",
]  # fmt: skip
ABOUT = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "gearsam_fused", "_version.py"))
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"
# A GCC whose -lstdc++ is the static archive (as in some CUDA container images) puts a second C++ runtime into the
# extension. Exported, that copy's data binds to the libstdc++.so torch loaded first while its functions stay its own:
# the streams and locales of two versions mix, and the first error message or file read crashes. Kept private, the
# copy is self-contained; no stream or locale object crosses into torch.
LINUX_LINK_FLAGS = ["-Wl,--exclude-libs,ALL"]
# Without GEARSAM_DEBUG=1: the debug information is most of the extension's size. -g0 after Python's -g drops it from
# the C++ objects; --strip-debug drops any left (nvcc's host objects, static libraries) and keeps the symbol table.
NO_DEBUG_CXX_FLAGS = ["-g0"]
NO_DEBUG_LINUX_LINK_FLAGS = ["-Wl,--strip-debug"]


def _switch(name: str, default: str = "auto") -> str:
    """The switch ``name``: ``auto``, ``0`` or ``1``, or, where its default is not ``auto``, ``0`` or ``1``."""
    values = ("auto", "0", "1") if default == "auto" else ("0", "1")
    value = os.environ.get(name, default).strip().lower()
    if value not in values:
        raise SystemExit(f"{name} must be {', '.join(values[:-1])} or {values[-1]}, got {value!r}")
    return value


def _skip(part: str, switch: str, why: str) -> None:
    """A part that cannot be built: an error if it was forced, else a warning."""
    if _switch(switch) == "1":
        raise SystemExit(f"{switch}=1 but the {part} cannot be built: {why}")
    warnings.warn(f"gearsam_fused: not building the {part}: {why}", stacklevel=2)


def _probe(compiler: str, flags: list[str]) -> str:
    """Why ``compiler`` does not compile and link an empty program with ``flags``: its first line of output, or ``""``
    where it does."""
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "probe.cpp")
        with open(source, "w") as fh:
            fh.write("int main() { return 0; }\n")
        command = [compiler, *flags, source, "-o", os.path.join(folder, "probe")]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as exc:
            return str(exc) or type(exc).__name__
        if done.returncode == 0:
            return ""
        lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        return lines[0] if lines else f"exit status {done.returncode}"


def _cxx_flags(openmp: bool, debug: bool) -> list[str]:
    """The C++ flags: -fopenmp where the compiler accepts it, -g0 unless a debug build is asked for."""
    # -ffp-contract=off: w + scale * g must round like the reference's separate multiply and add. -fno-math-errno:
    # std::sqrt need not set errno for a negative argument (its value is NaN either way), so loops with it vectorise.
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno"]
    # OpenMP threads ATen's parallel_for in the CPU kernels; without it they are correct but single-threaded.
    if openmp:
        flags.append("-fopenmp")
    return flags if debug else flags + NO_DEBUG_CXX_FLAGS


def _link_flags(cxx_flags: list[str], debug: bool) -> list[str]:
    """The link flags: -fopenmp as compiled, and on Linux the symbols of any static library kept private and, unless
    a debug build is asked for, the debug information stripped."""
    flags = [f for f in cxx_flags if f == "-fopenmp"]
    if not sys.platform.startswith("linux"):
        return flags
    return flags + LINUX_LINK_FLAGS + ([] if debug else NO_DEBUG_LINUX_LINK_FLAGS)


def _extension_build():
    """``(ext_modules, cmdclass)`` for the C++/CUDA extension, or ``([], {})`` when it is skipped."""
    if _switch("GEARSAM_BUILD_CPP") == "0":
        return [], {}
    debug = _switch("GEARSAM_DEBUG", default="0") == "1"
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        _skip("C++ extension", "GEARSAM_BUILD_CPP", f"torch is not importable ({exc}); install torch first and use "
              "pip install --no-build-isolation")  # fmt: skip
        return [], {}
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        _skip("C++ extension", "GEARSAM_BUILD_CPP", f"no C++ compiler ({compiler!r} is not on PATH)")
        return [], {}
    # Where the probe with -fopenmp fails, one without tells a compiler that lacks OpenMP from one that cannot build
    # anything, so the latter is reported as what it is and not as missing OpenMP.
    openmp = not _probe(compiler, ["-fopenmp"])
    if not openmp:
        why = _probe(compiler, [])
        if why:
            why = f"no working C++ compiler ({compiler!r} does not compile and link an empty program: {why})"
            _skip("C++ extension", "GEARSAM_BUILD_CPP", why)
            return [], {}
        warnings.warn(f"gearsam_fused: {compiler!r} rejects -fopenmp, so the CPU kernels run on one thread",
                      stacklevel=2)  # fmt: skip

    with_cuda = False
    if _switch("GEARSAM_BUILD_CUDA") != "0":
        if torch.version.cuda is None:
            _skip("CUDA kernels", "GEARSAM_BUILD_CUDA", "this torch is a CPU-only build")
        elif (
            cpp_extension.CUDA_HOME is None
            or shutil.which(os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")) is None
        ):
            _skip("CUDA kernels", "GEARSAM_BUILD_CUDA", "nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
        else:
            with_cuda = True

    cxx_flags = _cxx_flags(openmp, debug)
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    kwargs = dict(name="gearsam_fused._C", sources=sources, extra_link_args=_link_flags(cxx_flags, debug))
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
        kwargs["sources"] += sorted(glob.glob("csrc/cuda/*.cu"))
        kwargs["define_macros"] = [("WITH_CUDA", None)]
        kwargs["extra_compile_args"] = {"cxx": cxx_flags, "nvcc": ["-O3"]}
        extension = cpp_extension.CUDAExtension(**kwargs)
    else:
        kwargs["extra_compile_args"] = {"cxx": cxx_flags}
        extension = cpp_extension.CppExtension(**kwargs)

    class BuildOptionalExtension(cpp_extension.BuildExtension):
        """torch's ninja build, except that a failure leaves a working pure-Python install unless it was forced."""

        def build_extensions(self):
            try:
                super().build_extensions()
            except Exception as exc:  # a compiler error surfaces as one of several distutils exceptions
                _skip("C++ extension", "GEARSAM_BUILD_CPP", f"the build failed ({exc})")
                if not self.inplace:  # an earlier build's extension in build/ would otherwise go into the wheel
                    for ext in self.extensions:
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(self.get_ext_fullpath(ext.name))
                self.extensions = []  # nothing to copy into the package
                self.distribution.ext_modules = []  # the wheel is pure Python (WheelTaggedAsBuilt)

    cmdclass = {"build_ext": BuildOptionalExtension.with_options(use_ninja=True)}
    if bdist_wheel is not None:

        class WheelTaggedAsBuilt(bdist_wheel):
            """A wheel whose extension failed to build is pure Python, tagged ``py3-none-any``. bdist_wheel decides
            purity before the build; this decides it again right after, before anything is installed or tagged."""

            def run_command(self, command):
                super().run_command(command)
                if command == "build":
                    self.root_is_pure = not self.distribution.has_ext_modules()

        cmdclass["bdist_wheel"] = WheelTaggedAsBuilt
    return [extension], cmdclass


ext_modules, cmdclass = _extension_build()

setup(
    name="gearsam_fused",
    version=ABOUT["__version__"],
    description="Exact, fused sharpness-aware minimisation (SAM, ASAM, GEAR-SAM) for PyTorch",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=PACKAGES,
    package_dir={"gearsam_fused.triton_kernels": "triton_kernels"},
    install_requires=[f"torch>={ABOUT['MIN_TORCH']}", "numpy", "triton>=3.0; platform_system == 'Linux'"],
    extras_require={
        # tqdm: the progress bar of a run on a terminal; pillow: the image folders of the transfer study
        "demo": ["scikit-learn", "matplotlib", "tqdm", "pillow"],
        "transformers": ["transformers>=4.46", "accelerate>=1.0"],
        "lightning": ["lightning>=2.2"],
        "test": [
            "pytest",
            "pytest-benchmark",
            "pytest-xdist",  # the README's test command spreads the tests over the cores
            "pytorch_optimizer==4.1.0",  # pinned: the peer-parity tests bound the difference from this release
            "scikit-learn",
            "matplotlib",
            "tqdm",
            "pillow",
            "hypothesis",
            "transformers>=4.46",
            "accelerate>=1.0",
            "lightning>=2.2",
            "ruff==0.17.6",  # pinned: a new release may format differently, and CI checks the format
        ],
        # The documentation site (docs/, built with -W: a new release may warn differently). Sphinx 9 needs
        # Python >= 3.11.
        "docs": ["sphinx==9.0.4", "myst-parser==5.2.0", "furo==2025.12.19"],
    },
    entry_points={"console_scripts": ["gearsam = gearsam_fused.app.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
