"""GPU run for Hub ids: the carried cache (minivllm/tiny-text), then notebook 06's real-Qwen3 cells on a cache that
holds the qwen3-0.6b preset (random weights) as Qwen/Qwen3-0.6B, laid out on this machine. Writes $OUT/hub_check.json."""

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

OUT = Path(os.environ["OUT"])
cache = Path(os.environ["HF_HUB_CACHE"])
result: dict = {"hf_hub_offline": os.environ.get("HF_HUB_OFFLINE")}

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.checks.model_parity import greedy_agreement  # noqa: E402

snapshot = next((cache / "models--minivllm--tiny-text" / "snapshots").iterdir())
greedy = SamplingParams(temperature=0, max_tokens=24)
prompts = ["Once upon a time", "The Earth is about", "Dear Maria,"]
cli = subprocess.run(
    [
        sys.executable,
        "-m",
        "minivllm",
        "--model",
        "minivllm/tiny-text",
        "--max-tokens",
        "16",
        "Once upon a time",
    ],
    capture_output=True,
    text=True,
    timeout=300,
)
result["cli"] = {
    "rc": cli.returncode,
    "stdout_tail": cli.stdout[-600:],
    "stderr_tail": cli.stderr[-300:],
}
bad = subprocess.run(
    [sys.executable, "-m", "minivllm", "--model", "minivllm/not-there"],
    capture_output=True,
    text=True,
)
result["cli_unknown_id"] = {"rc": bad.returncode, "stderr": bad.stderr.strip()}
server = subprocess.Popen(
    [sys.executable, "-m", "minivllm.serve", "minivllm/tiny-text", "--port", "8123"],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
)
try:
    for _ in range(240):
        try:
            models = json.load(urllib.request.urlopen("http://127.0.0.1:8123/v1/models", timeout=2))
            break
        except OSError:
            time.sleep(0.5)
    body = json.dumps(
        {"model": "minivllm/tiny-text", "prompt": prompts[0], "max_tokens": 24, "temperature": 0}
    ).encode()
    req = urllib.request.Request(
        "http://127.0.0.1:8123/v1/completions", body, {"Content-Type": "application/json"}
    )
    completion = json.load(urllib.request.urlopen(req, timeout=60))
    result["server"] = {"models": models, "text": completion["choices"][0]["text"]}
except Exception as e:
    result["server"] = {"error": repr(e)}
finally:
    server.terminate()
    result.setdefault("server", {})["log_tail"] = server.communicate(timeout=30)[0][-1500:]
offline = LLM("minivllm/tiny-text")  # the server's defaults: its text must be this one
result["server"]["equals_offline"] = (
    result["server"].get("text")
    == offline.generate(prompts[:1], greedy, use_tqdm=False)[0].outputs[0].text
)
offline.close()
del offline
print(json.dumps({k: result[k] for k in ("cli", "cli_unknown_id", "server")}, indent=1), flush=True)
by_id = LLM("minivllm/tiny-text", dtype="bfloat16", max_model_len=1024)
outs = by_id.generate(prompts, greedy, use_tqdm=False)
by_id.close()
del by_id
by_folder = LLM(str(snapshot), dtype="bfloat16", max_model_len=1024)
folder_outs = by_folder.generate(prompts, greedy, use_tqdm=False)
by_folder.close()
del by_folder
result["llm_by_id"] = {
    "model_folder": str(snapshot),
    "same_tokens_as_folder": [o.outputs[0].token_ids for o in outs]
    == [o.outputs[0].token_ids for o in folder_outs],
    "texts": [o.outputs[0].text for o in outs],
    "teacher_forced_bf16": greedy_agreement(snapshot, outs),
}
print(json.dumps(result, indent=1), flush=True)


# notebook 06's cells up to the KV-block section, with Qwen/Qwen3-0.6B in the cache (random weights: no meaning)
from minivllm.checkpoint import write_checkpoint  # noqa: E402
from minivllm.testing import lay_out_hub_cache  # noqa: E402

start = time.perf_counter()
preset = write_checkpoint(Path("/tmp/qwen3-0.6b"), "qwen3-0.6b", seed=0)
lay_out_hub_cache(preset, cache, "Qwen/Qwen3-0.6B")
result["preset_written_s"] = round(time.perf_counter() - start, 1)
source = Path("notebooks/06_engine.py").read_text()
cells = source.split("\n# %%")
stop = next(i for i, c in enumerate(cells) if "## KV blocks over a whole run" in c)
os.chdir("notebooks")
scope: dict = {"__name__": "__main__"}
start = time.perf_counter()
for cell in cells[1:stop]:
    body = cell.split("\n", 1)[1] if "\n" in cell else ""
    if cell.lstrip().startswith("[markdown]") or 'tags=["export"]' in cell.split("\n", 1)[0]:
        continue  # prose, or the package's own code (already imported)
    exec(compile(body, "06_engine.py", "exec"), scope)
result["notebook06_cells"] = {
    "ran": stop - 1,
    "seconds": round(time.perf_counter() - start, 1),
    "real": scope["real"] is not None,
    "agreement": scope.get("agreement"),
}
(OUT / "hub_check.json").write_text(json.dumps(result, indent=1) + "\n")
print(json.dumps(result["notebook06_cells"], indent=1))
