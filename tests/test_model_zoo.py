"""Llama 3.x and Qwen2/2.5 (the deep dive model_zoo) through `from minivllm import LLM`, token for
token against transformers' generate on random tiny checkpoints of each family, fp32 on a CPU: plain,
preemption, chunked prefill, prefix caching, n > 1 with a seed, tensor parallelism over gloo, a Hub id
from a laid-out cache, the chat template; bf16 on a GPU under teacher forcing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.checkpoint import write_checkpoint
from minivllm.testing import edited_copy, lay_out_hub_cache

FAMILIES = ["tiny-llama", "tiny-qwen2"]
PROMPTS = [list(range(1, 9)), list(range(40, 90)), [7, 3, 500, 20, 9, 1000, 77, 5, 8, 6] * 3]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
CASES = {  # name: the engine's settings, the scheduler's counter that shows the path was taken
    "plain": ({}, None),
    "preemption": ({"num_kvcache_blocks": 7, "max_num_seqs": 4}, "num_preemptions"),
    "chunked prefill": ({"max_num_batched_tokens": 16, "max_num_seqs": 4}, None),
    "no prefix cache": ({"enable_prefix_caching": False}, None),
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("zoo") / request.param, request.param, seed=0)


@pytest.fixture(scope="module")
def expected(family) -> list[list[int]]:
    """transformers' greedy continuations of PROMPTS."""
    hf = AutoModelForCausalLM.from_pretrained(family, dtype=torch.float32).eval()
    kwargs = dict(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return [hf.generate(torch.tensor([p]), **kwargs)[0, len(p) :].tolist() for p in PROMPTS]


def small_llm(path: Path | str, **kwargs) -> LLM:
    settings = dict(device="cpu", max_model_len=128, num_kvcache_blocks=64, max_num_seqs=8)
    return LLM(str(path), **(settings | kwargs))


def greedy(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("case", CASES)
def test_every_engine_path_equals_transformers(family, expected, case):
    kwargs, counter = CASES[case]
    with small_llm(family, **kwargs) as llm:
        assert greedy(llm) == expected, case
        if counter:
            assert getattr(llm.engine.core.scheduler, counter) > 0, f"{case}: path not taken"


def test_a_prefix_cache_hit_equals_transformers(family, expected):
    with small_llm(family) as llm:
        greedy(llm)
        assert llm.engine.core.scheduler.block_manager.num_cached_free_blocks > 0
        assert greedy(llm) == expected  # the prompts' full blocks come from the cache


def test_n_samples_with_a_seed_repeat_and_greedy_n_equals_transformers(family, expected):
    seeded = SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=7, max_tokens=6, ignore_eos=True)
    greedy_n = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = []
    for caching in (True, False):
        with small_llm(family, enable_prefix_caching=caching) as llm:
            out = llm.generate(PROMPTS[:2], [seeded, greedy_n], use_tqdm=False)
            runs.append([list(c.token_ids) for c in out[0].outputs])
            assert [list(c.token_ids) for c in out[1].outputs] == [expected[1]] * 2
    assert runs[0] == runs[1] and len(runs[0]) == 3


def test_tensor_parallel_2_equals_transformers(family, expected):
    with small_llm(family, tensor_parallel_size=2) as llm:
        assert greedy(llm) == expected


def test_a_hub_id_from_a_laid_out_cache(family, expected, tmp_path):
    lay_out_hub_cache(family, tmp_path, f"minivllm/{family.name}")
    code = (
        "import json, sys; from minivllm import LLM, SamplingParams\n"
        "llm = LLM(sys.argv[1], device='cpu', max_model_len=128, num_kvcache_blocks=64)\n"
        "p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)\n"
        f"print(json.dumps([list(o.outputs[0].token_ids) for o in llm.generate({PROMPTS!r}, p)]))\n"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, f"minivllm/{family.name}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # a hang check, not a timing
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(expected).replace("'", '"')


# Llama 3's chat format (the tiny tokenizer spells its header tokens as plain text)
LLAMA3_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def test_chat_and_the_server_format_with_the_checkpoint_s_template(family, tmp_path):
    """LLM.chat and the server's chat route both format messages with the template the checkpoint
    carries (Llama 3's here), and reply with the same greedy tokens."""
    import httpx

    from minivllm.async_llm import AsyncLLM
    from minivllm.serve.testing import serve_in_thread

    folder = edited_copy(family, tmp_path / family.name)
    (folder / "chat_template.jinja").write_text(LLAMA3_TEMPLATE)
    messages = [{"role": "user", "content": "Hello"}]
    with small_llm(folder) as llm:
        tokenizer = llm.get_tokenizer()
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text.startswith("<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>")
        ids = tokenizer.encode(text)
        chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
        assert list(chat.prompt_token_ids) == ids
        assert list(chat.outputs[0].token_ids) == greedy(llm, [ids])[0]
    settings = dict(device="cpu", max_model_len=128, num_kvcache_blocks=64, max_num_seqs=8)
    engine = AsyncLLM(str(folder), multiprocessing=False, **settings)
    body = dict(model="zoo", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    try:
        with serve_in_thread(engine, "zoo") as url:
            url += "/v1/chat/completions"
            reply = httpx.post(url, json=body | dict(ignore_eos=True), timeout=120).json()
    finally:
        engine.close()
    assert reply["usage"] == dict(
        prompt_tokens=len(ids), completion_tokens=MAX_TOKENS, total_tokens=len(ids) + MAX_TOKENS
    ), reply
    assert reply["choices"][0]["message"]["content"] == chat.outputs[0].text


def test_notebook_06_s_llm_stays_qwen3_and_names_what_it_supports(family):
    from minivllm.llm import LLM as CoreLLM

    with pytest.raises(ValueError, match="Qwen3ForCausalLM") as refused:
        CoreLLM(str(family), device="cpu", max_model_len=64)
    assert "not supported" in str(refused.value)


def test_an_unsupported_architecture_names_itself_and_the_zoo(family, tmp_path):
    other = edited_copy(family, tmp_path / "other", lambda c: c.update(architectures=["GPT2"]))
    with pytest.raises(ValueError) as refused:
        small_llm(other)
    words = ["GPT2", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
    assert all(w in str(refused.value) for w in words)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("preset", ["llama-3.2-1b", "qwen2.5-0.5b"])
def test_bf16_on_a_gpu_is_as_close_to_fp32_as_transformers_is(preset):
    """tests/test_model.py's Qwen3 check on each family's real shapes (random weights)."""
    from minivllm.checks.model_parity import run_model_parity

    result = run_model_parity(preset, num_tokens=1024)
    rows = {(row["impl"], row["reference"]): row for row in result["rows"]}
    ours = rows["minivllm-bf16", "transformers-fp32"]
    theirs = rows["transformers-bf16", "transformers-fp32"]
    assert rows["minivllm-fp32", "transformers-fp32"]["max_abs_logit_error"] < 1e-2
    assert ours["top1_agreement"] >= theirs["top1_agreement"] - 0.03, (ours, theirs)
    assert ours["mean_abs_logit_error"] <= 1.5 * theirs["mean_abs_logit_error"], (ours, theirs)
    assert ours["max_abs_logit_error"] <= 2 * theirs["max_abs_logit_error"], (ours, theirs)
    assert rows["minivllm-bf16", "transformers-bf16"]["top1_agreement"] >= 0.9
