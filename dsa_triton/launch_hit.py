"""The compiled hit of the lean launch path (``launch_hit.cpp``: a layout's hit in one call), built at first use.

As Triton builds its CUDA launcher: the source is compiled once per torch, Python and platform into a shared module
kept in Triton's cache directory (``~/.triton/cache`` unless ``TRITON_CACHE_DIR`` says otherwise), then loaded from
there. It reads tensors through torch's C++ API, so it is C++ built against the running torch's headers and libraries
(a build of seconds, once). :func:`compiled_hit` is None where no C++ compiler is found, or the build or the
load fails (one warning says why): :mod:`dsa_triton.launch` then hits through each layout's Python function, the
reference.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path
from types import ModuleType

import torch

NAME = "dsa_launch_hit"  # the module's name (its PyInit_ function)
SOURCE = Path(__file__).with_name("launch_hit.cpp")


@functools.cache
def compiled_hit() -> ModuleType | None:
    """The built module (the type ``Hit``, and the device types ``CPU`` and ``CUDA``), or None (a warning says
    why)."""
    try:
        return _load()
    except Exception as exc:  # no compiler, no torch headers, a failed build or load: the Python hit serves
        detail = getattr(exc, "stderr", None) or ""
        warnings.warn(f"dsa_triton.launch: the compiled hit is not available ({exc}{detail[-2000:]}); launches hit "
                      "through Python", RuntimeWarning, stacklevel=2)
        return None


def compiler() -> str | None:
    """The C++ compiler the module is built with: ``CXX``, else the first of c++, g++, clang++ on the path."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _load() -> ModuleType:
    from torch.utils.cpp_extension import include_paths, library_paths
    from triton.runtime.cache import get_cache_manager

    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX)")
    scheme = sysconfig.get_default_scheme()  # (Debian's posix_local has no include path: Triton's build does this)
    python_include = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]
    libraries = library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    command = ["-O2", "-std=c++20", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{python_include}",
               *(f"-I{d}" for d in include_paths()), *(f"-L{d}" for d in libraries),
               *(f"-Wl,-rpath,{d}" for d in libraries), "-lc10", "-ltorch_cpu", "-ltorch_python"]
    source = SOURCE.read_text()
    key = hashlib.sha256("\n".join([source, torch.__version__, torch.__file__, sys.version, platform.platform(),
                                    cxx, *command]).encode()).hexdigest()
    cache = get_cache_manager(key)
    filename = NAME + sysconfig.get_config_var("EXT_SUFFIX")
    path = cache.get_file(filename)
    if path is None:
        with tempfile.TemporaryDirectory() as tmp:
            src, so = os.path.join(tmp, NAME + ".cpp"), os.path.join(tmp, filename)
            Path(src).write_text(source)
            subprocess.run([cxx, src, "-o", so, *command], check=True, capture_output=True, text=True)
            path = cache.put(Path(so).read_bytes(), filename, binary=True)
    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
