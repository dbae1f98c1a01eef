"""Let the oldest-torch venv load its CUDA libraries from the main venv rather than hold a copy of its own.

Each torch release pins its own CUDA wheels (2.7 GB, 3.3 GB with triton), so a second venv doubles them, and a
CI machine's disk has not always had room for both. The compatibility tests run on the CPU: torch only has to
load those libraries, which it does by soname (libcudnn.so.9, libcublas.so.13), so any release of the same CUDA
major will do. This drops the CUDA requirements from the installed torch's metadata (so that installing the
project does not bring them back) and links the main venv's `nvidia` folder in.

usage: python share_cuda_libraries.py OLDEST_SITE_PACKAGES MAIN_SITE_PACKAGES
Exit status 3 (nothing changed) when the two cannot share: the caller then installs torch's requirements as usual.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

CUDA_REQUIREMENT = re.compile(r"^Requires-Dist: (nvidia-|cuda-|triton)", re.IGNORECASE)


def _torch_metadata(site: Path) -> Path | None:
    found = sorted(site.glob("torch-*.dist-info/METADATA"))
    return found[0] if found else None


def _cuda_major_of_torch(site: Path) -> str | None:
    built = site / "torch" / "version.py"
    version = re.search(r"^cuda\b.*= '(\d+)\.", built.read_text(), re.MULTILINE) if built.exists() else None
    return version.group(1) if version else None


def _cuda_major_of_libraries(site: Path) -> str | None:
    runtime = sorted(site.glob("nvidia_cuda_runtime*.dist-info/METADATA"))
    if not runtime:
        return None
    version = re.search(r"^Version: (\d+)\.", runtime[0].read_text(), re.MULTILINE)
    return version.group(1) if version else None


def share(oldest: Path, main: Path) -> str | None:
    """Link main's CUDA libraries into oldest; the reason it cannot, or None when done."""
    metadata = _torch_metadata(oldest)
    if metadata is None:
        return f"no torch installed in {oldest}"
    wanted, offered = _cuda_major_of_torch(oldest), _cuda_major_of_libraries(main)
    if wanted is None or offered is None or wanted != offered or not (main / "nvidia").is_dir():
        return f"torch in {oldest} wants CUDA {wanted}, {main} has {offered}"
    link = oldest / "nvidia"
    if link.is_dir() and not link.is_symlink():
        return f"{oldest} has CUDA libraries of its own"
    lines = metadata.read_text().splitlines(keepends=True)
    metadata.write_text("".join(line for line in lines if not CUDA_REQUIREMENT.match(line)))
    if link.is_symlink():
        link.unlink()
    link.symlink_to((main / "nvidia").resolve(), target_is_directory=True)
    return None


if __name__ == "__main__":
    reason = share(Path(sys.argv[1]), Path(sys.argv[2]))
    if reason is not None:
        print(f"the CUDA libraries are not shared ({reason}): torch's own requirements stand", file=sys.stderr)
        sys.exit(3)
