"""What a process pays before its first token: `import pagedecode` and a GGUF load import none
of the heavy optional modules (transformers through xgrammar, jinja2, the server's stack; Triton
under a torch that cannot run it), each checked in a fresh interpreter, as a user starts one."""
import json
import os
import subprocess
import sys

import pytest
import torch

# imported only when first needed: structured output (xgrammar, which imports transformers), chat
# templates (jinja2), the server (starlette, uvicorn), quantizing a float checkpoint (gguf)
LATER = ("transformers", "xgrammar", "jinja2", "starlette", "uvicorn", "gguf", "safetensors")
CPU_TORCH = torch.version.cuda is None and torch.version.hip is None


def imported_after(code: str, interpret: bool = False) -> list[str]:
    """The modules of LATER (and triton) in sys.modules after running `code` in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}     # tests set it; users do not
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in {(*LATER, 'triton')!r} if m in sys.modules)))"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return list(json.loads(r.stdout.strip().splitlines()[-1]))


def test_import_pagedecode_imports_no_optional_module():
    got = imported_after("import pagedecode")
    assert set(got) <= (set() if CPU_TORCH else {"triton"}), got


@pytest.mark.skipif(not CPU_TORCH, reason="a CUDA torch imports Triton for its kernels")
def test_triton_is_imported_where_it_can_run():
    """Under a CPU-only torch Triton runs only in its interpreter: imported then, not otherwise."""
    assert "triton" not in imported_after("import pagedecode")
    pytest.importorskip("triton")
    assert "triton" in imported_after("import pagedecode", interpret=True)


def test_loading_a_gguf_file_and_a_token_import_none_of_them(smollm2_path):
    code = (f"import pagedecode as pd\nengine = pd.Engine.from_pretrained({str(smollm2_path)!r})\n"
            "engine.generate(['Hi'], pd.SamplingParams(max_tokens=1))")
    got = imported_after(code)
    assert set(got) <= (set() if CPU_TORCH else {"triton"}), got
