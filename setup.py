"""Build hook: ship the C++/CUDA/AscendC sources in wheels as ``opmux/_csrc``.

The plugins compile them on first use (``opmux/plugins/build_cache.py`` finds them there, or in
``csrc/`` of a source checkout for editable installs). A build writes its intermediate files
(``build/``, ``*.egg-info``) in a temporary directory, so ``pip install .`` leaves the
checkout as it was. Everything else is in pyproject.toml.
"""

import shutil
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithSources(build_py):
    def run(self) -> None:
        super().run()
        src = Path(__file__).resolve().parent / "csrc"
        if src.is_dir() and not getattr(self, "editable_mode", False):
            shutil.copytree(src, Path(self.build_lib) / "opmux" / "_csrc", dirs_exist_ok=True)


_scratch = tempfile.mkdtemp(prefix="opmux-build-")
setup(cmdclass={"build_py": BuildPyWithSources},
      options={"build": {"build_base": _scratch}, "egg_info": {"egg_base": _scratch}})
