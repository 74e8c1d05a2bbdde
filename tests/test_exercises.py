"""Every exercise, unmodified, stops at its first check with "... is not written yet"; every solution has checks;
and a plausible wrong answer to each exercise, one that skips its point, fails a check whose message names the case.

CI runs the solutions themselves (`pytest --nbval-lax solutions`), so they are not run again here: an exercise runs
only up to its first check cell, which must be the first cell to fail, and must fail for the right reason. A wrong
solution runs its solution's cells in this process up to the check it must fail.
"""

import os
import re
from pathlib import Path
from textwrap import dedent

import pytest

nbformat = pytest.importorskip(
    "nbformat"
)  # a GPU machine running `pytest -m gpu` may not have the notebook tools
nbclient = pytest.importorskip("nbclient")
jupytext = pytest.importorskip("jupytext")
ipykernel_spec = pytest.importorskip("ipykernel.kernelspec")
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402
from nbclient.exceptions import CellExecutionError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXERCISES = sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.py"))
CHECK = "with exercise("
NOT_WRITTEN = "is not written yet"
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colours in a kernel's traceback
CELL_TIMEOUT_S = 300  # a cell, or the kernel's start: a ceiling a loaded 2-core machine keeps; none comes near it


class CurrentEnvKernelSpecs(KernelSpecManager):
    """Whatever kernel a notebook names, run it with this interpreter (as nbval's --nbval-current-env does)."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return KernelSpec(resource_dir=ipykernel_spec.RESOURCES, **ipykernel_spec.get_kernel_dict())


def is_check(cell) -> bool:
    return cell.cell_type == "code" and CHECK in cell.source


def test_there_are_exercises_for_every_solution():
    assert SOLUTIONS, "no solutions/NN_name.py found"
    names = sorted(p.stem for p in SOLUTIONS)
    assert sorted(p.stem for p in EXERCISES) == names, (
        f"exercises/ holds {[p.name for p in EXERCISES]}, solutions/ {names}: run `python tools/export.py`"
    )


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_solution_has_checks_and_solution_blocks(path: Path):
    cells = jupytext.read(path, fmt="py:percent").cells
    checks = [i for i, c in enumerate(cells) if is_check(c)]
    blocks = [
        i for i, c in enumerate(cells) if c.cell_type == "code" and "# BEGIN SOLUTION" in c.source
    ]
    assert checks, f"{path.name}: no check cell (a code cell with `{CHECK}...)`)"
    assert blocks, (
        f"{path.name}: no `# BEGIN SOLUTION` ... `# END SOLUTION` block for the learner to write"
    )
    assert blocks[0] < checks[0], (
        f"{path.name}: the first check (cell {checks[0]}) comes before any solution block"
    )


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.stem)
def test_unsolved_exercise_stops_at_its_first_check(path: Path):
    nb = nbformat.read(path, as_version=4)
    first_check = next((i for i, c in enumerate(nb.cells) if is_check(c)), None)
    assert first_check is not None, f"{path.name}: no check cell (a code cell with `{CHECK}...)`)"
    nb.cells = nb.cells[: first_check + 1]  # nothing after the first check runs

    km = KernelManager(kernel_name="python3", kernel_spec_manager=CurrentEnvKernelSpecs())
    resources = {"metadata": {"path": str(path.parent)}}
    client = nbclient.NotebookClient(
        nb, km=km, timeout=CELL_TIMEOUT_S, startup_timeout=CELL_TIMEOUT_S, resources=resources
    )
    with client.setup_kernel(
        env=os.environ | {"CI": "true"}
    ):  # cwd: the exercises folder (resources' path)
        for index, cell in enumerate(nb.cells[:first_check]):
            if cell.cell_type != "code":
                continue
            try:
                client.execute_cell(cell, index)
            except CellExecutionError as e:
                traceback = ANSI.sub("", str(e))
                pytest.fail(
                    f"{path.name}: cell {index}, before the first check (cell {first_check}), failed:\n{traceback}"
                )
        try:
            client.execute_cell(nb.cells[first_check], first_check)
        except CellExecutionError as e:
            assert e.ename == "AssertionError" and NOT_WRITTEN in e.evalue, (
                f"{path.name}: the first check (cell {first_check}) should fail with AssertionError('... "
                f"{NOT_WRITTEN} ...'), got {e.ename}: {e.evalue}"
            )
        else:
            pytest.fail(
                f"{path.name}: the first check (cell {first_check}) passed: does the exercise ship solved?"
            )


# A plausible wrong answer for each exercise, one that skips its point: the solution's cells run in this process
# (fast: no kernel to start), `wrong` is executed just before the first check cell that contains `marker`, and that
# check must fail with an AssertionError whose message names the case (`message`, a regular expression).
WRONG_SOLUTIONS: dict[
    str, tuple[str, str, str, str]
] = {}  # id -> (solution, marker, wrong code, message)


def wrong(id: str, solution: str, marker: str, code: str, message: str) -> None:
    WRONG_SOLUTIONS[id] = (solution, marker, dedent(code), message)


wrong(
    "mixed attention: the prefill kernel over every row, no decode kernel",
    "04_mixed_attention",
    'exercise("mixed_attention")',
    """
    def mixed_attention(q, k_cache, v_cache, cu_q, cu_k, block_table, scale):
        out = torch.empty_like(q)
        block_m = launch_config(q.shape[2], q.device)["BLOCK_M"]
        q_lens, k_lens = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
        tiles = my_query_tiles(cu_q.cpu().numpy(), cu_k.cpu().numpy(), np.arange(len(q_lens)), block_m)
        flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, int(q_lens.max()), int(k_lens.max()), scale,
                               causal=True, block_table=block_table, out=out, tiles=torch.from_numpy(tiles))
        return out
    """,
    r"case 0: q_lens \[.*\], decode rows of sequences \[.*\]: the decode kernel ran 0 times on 0 rows",
)
wrong(
    "mixed attention: the decode rows assumed first, as notebook 04 has them",
    "04_mixed_attention",
    'exercise("mixed_attention")',
    """
    def mixed_attention(q, k_cache, v_cache, cu_q, cu_k, block_table, scale):
        out = torch.empty_like(q)
        q_lens, k_lens = (cu_q[1:] - cu_q[:-1]).numpy(), (cu_k[1:] - cu_k[:-1]).numpy()
        n = int((q_lens == 1).sum())
        if n:
            cache_seqlens = torch.from_numpy(k_lens[:n].astype(np.int32))
            flash_attn_with_kvcache(q[:n].unsqueeze(1), k_cache, v_cache, cache_seqlens, block_table[:n], scale,
                                    out=out[:n].unsqueeze(1))
        if n < len(q_lens):
            tiles = my_query_tiles(cu_q.numpy(), cu_k.numpy(), np.arange(n, len(q_lens)), 16)
            flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, int(q_lens.max()), int(k_lens.max()), scale,
                                   causal=True, block_table=block_table, out=out, tiles=torch.from_numpy(tiles))
        return out
    """,
    r"case \d: q_lens .*: (sequence \d+ \(decode row\) differs|the prefill kernel's tiles include the decode row)",
)
wrong(
    "mixed attention work list: every sequence's tiles, not only those asked for",
    "04_mixed_attention",
    'exercise("my_query_tiles")',
    """
    _right_tiles = my_query_tiles
    def my_query_tiles(cu_seqlens_q, cu_seqlens_k, seqs, block_m):
        return _right_tiles(cu_seqlens_q, cu_seqlens_k, np.arange(len(cu_seqlens_q) - 1), block_m)
    """,
    r"notebook 04's step: expected \[\[2, 1\], \[2, 0\], \[3, 0\]\]",
)
wrong(
    "cascade: query head h reads KV head h % num_kv_heads, not h // group",
    "03_cascade_attention",
    'exercise("prefix_attention")',
    """
    def prefix_attention(q, k, v, scale):
        heads = torch.arange(q.shape[1]) % k.shape[1]
        scores = torch.einsum("rhd,nhd->rhn", q, k[:, heads]) * scale
        out = torch.einsum("rhn,nhd->rhd", torch.softmax(scores, dim=-1), v[:, heads])
        return out, torch.logsumexp(scores, dim=-1)
    """,
    r"5 rows over 40 shared keys, query head 1 \(KV head 0\): out differs",
)
wrong(
    "cascade: merge averages the two parts, not weighted by their sums",
    "03_cascade_attention",
    'exercise("merge")',
    """
    def merge(out_a, lse_a, out_b, lse_b):
        return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)
    """,
    r"keys cut at 1: out",
)
wrong(
    "triton rmsnorm: the mean over BLOCK lanes, not n_cols",
    "01_triton_rmsnorm",
    'exercise("fused_add_rms_norm_kernel")',
    """
    @triton.jit
    def fused_add_rms_norm_kernel(X, R, W, OUT, R_OUT, stride_x, stride_r, stride_out, stride_r_out, n_cols, eps,
                                  BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(R_OUT.dtype.element_ty)
        tl.store(R_OUT + row * stride_r_out + cols, s, mask=mask)
        s = s.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(s * s, axis=0) / BLOCK + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + row * stride_out + cols, (s * inv_rms * w).to(OUT.dtype.element_ty), mask=mask)
    """,
    r"5 x 96, torch.float32, output",
)
LLAMA3_INV_FREQ = """
def llama3_inv_freq(inv_freq, params):
    factor, original = params["factor"], params["original_max_position_embeddings"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    wavelength = 2 * torch.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    blended = BLEND
    scaled = torch.where(wavelength > LONG, inv_freq / factor, blended)
    return torch.where(wavelength < SHORT, inv_freq, scaled)
"""
wrong(
    "llama: llama3 RoPE's blend weighted the wrong way round",
    "02_llama",
    'exercise("llama3_inv_freq")',
    LLAMA3_INV_FREQ.replace("BLEND", "smooth * inv_freq / factor + (1 - smooth) * inv_freq")
    .replace("LONG", "original / low")
    .replace("SHORT", "original / high"),
    r"the tiny Llama .*: frequency pair 8 \(wavelength [\d,]+ positions, between 2,048 and 8,192: "
    r"blended\): yours .*, transformers'",
)
wrong(
    "llama: llama3 RoPE's bands fixed at Llama-3's 2,048 and 8,192",
    "02_llama",
    'exercise("llama3_inv_freq")',
    LLAMA3_INV_FREQ.replace("BLEND", "(1 - smooth) * inv_freq / factor + smooth * inv_freq")
    .replace("LONG", "8192")
    .replace("SHORT", "2048"),
    r"made up .*: frequency pair \d+ \(wavelength [\d,]+ positions, (longer than 512|between 128)",
)
wrong(
    "llama: gate_proj and up_proj swapped in the checkpoint mapping",
    "02_llama",
    'exercise("checkpoint_packing")',
    """
    def checkpoint_packing():
        return {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                "gate_proj": ("gate_up_proj", 1), "up_proj": ("gate_up_proj", 0)}
    """,
    r"gate_proj maps to shard 1, expected 0: as shard 1, transformers' gate_proj does not compute "
    r"columns 0:384 of gate_up_proj's output, where our forward reads it",
)
LLAMA_ATTENTION = """
_LlamaAttention = LlamaAttention
class LlamaAttention(_LlamaAttention):  # the solution's forward
    def __init__(self, config, rotary_emb, layer_idx):
        nn.Module.__init__(self)
        head_dim, heads, kv_heads = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, heads, kv_heads, bias=config.attention_bias)
        self.num_heads, self.num_kv_heads, self.head_dim = HEADS, head_dim
        self.o_proj = RowParallelLinear(O_PROJ_IN, config.hidden_size, bias=config.attention_bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, layer_idx)
"""
wrong(
    "llama: the attention's heads read from the config, not divided over the ranks",
    "02_llama",
    'exercise("LlamaAttention at TP=2")',
    LLAMA_ATTENTION.replace("HEADS", "heads, kv_heads").replace("O_PROJ_IN", "heads * head_dim"),
    r"TP=2, rank 0: \(num_heads, num_kv_heads\) = \(4, 2\), expected \(2, 1\)",
)
wrong(
    "llama: o_proj sized for this rank's heads, then divided again by RowParallelLinear",
    "02_llama",
    'exercise("LlamaAttention at TP=2")',
    LLAMA_ATTENTION.replace("HEADS", "self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads").replace(
        "O_PROJ_IN", "self.num_heads * head_dim"
    ),
    r"TP=2, rank 0: loading transformers' o_proj.weight into your o_proj.weight",
)

ONLINE_SOFTMAX_LOOP = """
def attend_blocks(q, k, v, block_n, causal=False, window=0):
    (M, D), N = q.shape, k.shape[0]
    m, l, acc = torch.full((M,), NEG_INF), torch.zeros(M), torch.zeros(M, D)
    for start in range(0, N, block_n):  # every block, from 0
        end = min(start + block_n, N)
        s = (q @ k[start:end].T) * D**-0.5
        if causal:
            key_pos, query_pos = torch.arange(start, end)[None, :], torch.arange(M)[:, None] + (N - M)
            visible = key_pos <= query_pos
            if window and WINDOW_MASK:
                visible &= key_pos > query_pos - window
            s = s.masked_fill(~visible, NEG_INF)
        m_new = torch.maximum(m, s.max(dim=1).values)
        m_safe = m_new.masked_fill(m_new == NEG_INF, 0.0)
        p, alpha = torch.exp(s - m_safe[:, None]), torch.exp(m - m_safe)
        l, acc, m = alpha * l + p.sum(dim=1), alpha[:, None] * acc + p @ v[start:end], m_new
    return acc / torch.where(l > 0, l, 1.0)[:, None], m + torch.log(l)
"""
wrong(
    "online softmax: the window masked, but every block read",
    "01_online_softmax",
    'exercise("attend_blocks")',
    "WINDOW_MASK = True" + ONLINE_SOFTMAX_LOOP,
    r"window 16, a chunk of 16 after 84 cached keys: out vs the reference \(blocks 0\.\.3 hold NaN.*\): NaN at",
)
wrong(
    "online softmax: no window at all",
    "01_online_softmax",
    'exercise("attend_blocks")',
    "WINDOW_MASK = False"
    + ONLINE_SOFTMAX_LOOP.replace(
        "range(0, N", "range((max(0, N - M - window + 1) if window else 0) // block_n * block_n, N"
    ),
    r"window 8, M=N=37, blocks of 8: out vs the reference.*Tensor-likes are not close",
)

wrong(
    "typical-p: sorted by probability (top-p), not by distance to the entropy",
    "04_sampler_filters",
    'exercise("typical_mask")',
    """
    def typical_mask(logprobs, typical_ps):
        p = logprobs.exp()
        order = p.argsort(dim=-1, descending=True, stable=True)
        sorted_p = p.gather(-1, order)
        keep = (sorted_p.cumsum(-1) - sorted_p < typical_ps[:, None]) | (typical_ps[:, None] >= 1)
        return torch.empty_like(keep).scatter_(-1, order, keep)
    """,
    r"p = \[0.4, 0.3, 0.2, 0.1\], tau 0.25: .*: expected tokens \[1\], got \[0\]",
)
wrong(
    "typical-p: the filter chosen before the temperature",
    "04_sampler_filters",
    'exercise("sample")',
    """
    def sample(logits, temperatures, typical_ps, generator):
        greedy = temperatures == 0
        keep = typical_mask(torch.log_softmax(logits, dim=-1), typical_ps)  # on the raw logits
        probs = torch.softmax(logits / torch.where(greedy, 1.0, temperatures)[:, None], dim=-1) * keep
        q = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(1e-10)
        return torch.where(greedy, logits.argmax(dim=-1), (probs / q).argmax(dim=-1))
    """,
    r"temperature 0.5, typical_p 0.5: (dropped token|token \d+ drawn with frequency)",
)

wrong(
    "prefix cache LFU: hits counted, but still the least recently freed evicted",
    "03_prefix_caching",
    'exercise("LFUBlockManager._take_free_block")',
    """
    def _take_free_block(self):
        block = BlockManager._take_free_block(self)  # popitem(last=False): LRU
        self.hits[block.block_id] = 0
        return block
    LFUBlockManager._take_free_block = _take_free_block
    """,
    r"LFUBlockManager: after a 5-block prompt evicted one of .*, \[7, 8\] is still cached; expected \[1, 2\]",
)
wrong(
    "prefix cache LFU: an evicted block keeps its hits",
    "03_prefix_caching",
    'exercise("LFUBlockManager")',
    """
    _right_take = LFUBlockManager._take_free_block
    def _take_free_block(self):
        hits = list(self.hits)
        block = _right_take(self)
        self.hits[block.block_id] = hits[block.block_id]
        return block
    LFUBlockManager._take_free_block = _take_free_block
    """,
    r"after step \d+, .*: (block \d+ has \d+ hits, the scan's \d+|.* hit \d+ tokens, the scan's \d+)",
)

wrong(
    "paged allocator: forks, but a shared last block written in place (no copy-on-write)",
    "03_paged_allocator",
    'exercise("can_append / may_append")',
    """
    def _may_append(self, seq):
        if len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take_block())
        return []
    def _can_append(self, seq):
        return self.num_free_blocks >= (len(seq.block_table) < seq.num_blocks)
    SimpleBlockManager.may_append, SimpleBlockManager.can_append = _may_append, _can_append
    """,
    r"token 6 goes into block \d+, which 3 sequences hold: expected a private copy",
)
wrong(
    "paged allocator: a fork that shares the table but counts no holders",
    "03_paged_allocator",
    "test_allocator()",
    """
    def _fork(self, parent, child):
        child.block_table = list(parent.block_table)
    SimpleBlockManager.fork = _fork
    """,
    r"block \d+: ref count \d+, held by \d+ live tables",
)

wrong(
    "verify step: a prefill's rows scored, each sequence's last only",
    "04_verify_step",
    'exercise("verify_inputs")',
    """
    def verify_inputs(seqs, drafts, block_size):
        for seq, tokens in zip(seqs, drafts):
            for token in tokens:
                seq.append_token(token)
            seq.num_scheduled_tokens = len(seq) - seq.num_cached_tokens
        return prepare_prefill(seqs, block_size)
    """,
    r"38 tokens \+ 2 drafts, .*, logits_rows: expected an array, got None",
)
wrong(
    "verify step: the newest token taken for cached, only the drafts computed",
    "04_verify_step",
    'exercise("verify_inputs")',
    """
    def verify_inputs(seqs, drafts, block_size):
        for seq, tokens in zip(seqs, drafts):
            seq.num_cached_tokens = len(seq)
            for token in tokens:
                seq.append_token(token)
            seq.num_scheduled_tokens = max(1, len(tokens))
            seq.num_cached_tokens = len(seq) - seq.num_scheduled_tokens
        step = prepare_prefill(seqs, block_size)
        step.logits_rows = np.arange(len(step.input_ids))
        return step
    """,
    r"38 tokens \+ 2 drafts, .*, input_ids:\nexpected \[\d+, 5, 6, \d+\]\ngot      \[5, 6, \d+\]",
)
ACCEPT = """
def accept(logits, drafts):
    choices = logits.argmax(dim=-1).tolist()
    accepted, bonus, row = [], [], 0
    for tokens in drafts:
        KEEP
        accepted.append(keep)
        bonus.append(choices[row + keep])
        row += 1 + len(tokens)
    return accepted, bonus
"""
wrong(
    "verify step: draft j judged by row j + 1, off by one",
    "04_verify_step",
    'exercise("accept")',
    ACCEPT.replace(
        "KEEP",
        "keep = 0\n        while keep < len(tokens) and tokens[keep] == choices[row + keep + 1]:\n"
        "            keep += 1",
    ),
    r"sequence 0: drafts \[5, 7, 9\], the argmax of its 4 rows \[5, 7, 2, 4\]: expected 2 accepted "
    r"and bonus 2, got 0 and 5",
)
wrong(
    "verify step: every draft that matches accepted, not only the leading ones",
    "04_verify_step",
    'exercise("accept")',
    ACCEPT.replace("KEEP", "keep = sum(t == choices[row + j] for j, t in enumerate(tokens))"),
    r"sequence 3: drafts \[5, 8, 9\], .*: expected 1 accepted and bonus 7, got 2 and 9",
)

wrong(
    "find the bug: a 'hit' check whose shared prefix is shorter than a block",
    "04_find_the_bug",
    'exercise("prefix_hit_check")',
    """
    def prefix_hit_check(runner):
        prefix = random.Random(0).choices(range(2048), k=10)  # less than a block of 16: nothing to share
        bm = BlockManager(runner.num_kvcache_blocks, runner.block_size)
        first, second = Sequence(prefix + [1, 2], block_size=16), Sequence(prefix + [3, 4, 5], block_size=16)
        admit(bm, first)
        runner.step_logits([first], is_prefill=True)
        admit(bm, second)
        logits = runner.step_logits([second], is_prefill=True)[0]
        error = (logits - prompt_logits(reference, second.token_ids)[-1]).abs().max().item()
        cached = second.num_cached_tokens
        for seq in (first, second):
            bm.deallocate(seq)
        return cached, error
    """,
    r"SuspectContext: the second request found nothing in the prefix cache \(num_cached_tokens = 0\)",
)
wrong(
    "find the bug: the fix handed over from PagedContext",
    "04_find_the_bug",
    'exercise("FixedContext.prefill")',
    """
    class FixedContext(SuspectContext):
        def prefill(self, layer, q, k, v):
            return PagedContext.prefill(self, layer, q, k, v)
    """,
    r"FixedContext.prefill called PagedContext's prefill",
)


def test_every_exercise_has_a_wrong_solution():
    covered = {solution for solution, *_ in WRONG_SOLUTIONS.values()}
    missing = sorted(p.stem for p in SOLUTIONS if p.stem not in covered)
    assert not missing, (
        f"no wrong solution in WRONG_SOLUTIONS for {missing}: add one that skips the exercise's point"
    )


@pytest.mark.parametrize("case", list(WRONG_SOLUTIONS), ids=str)
def test_wrong_solution_fails_its_check(case: str, monkeypatch: pytest.MonkeyPatch):
    solution, marker, code, message = WRONG_SOLUTIONS[case]
    monkeypatch.chdir(ROOT / "solutions")  # where the notebook runs
    monkeypatch.setenv("MPLBACKEND", "Agg")
    cells = [
        c for c in jupytext.read(ROOT / "solutions" / f"{solution}.py", fmt="py:percent").cells
    ]
    namespace: dict = {"__name__": "__main__"}
    for index, cell in enumerate(cells):
        if cell.cell_type != "code":
            continue
        source = compile(cell.source, f"{solution}.py, cell {index}", "exec")
        if is_check(cell) and marker in cell.source:
            exec(compile(code, f"wrong solution {case}", "exec"), namespace)
            with pytest.raises(AssertionError) as failure:
                exec(source, namespace)
            assert re.search(message, str(failure.value)), (
                f"{case}: the check failed, but its message does not name the case ({message!r}):\n{failure.value}"
            )
            return
        exec(source, namespace)
    pytest.fail(f"{solution}.py: no check cell containing {marker!r}")
