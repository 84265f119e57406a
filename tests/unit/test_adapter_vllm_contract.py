"""Contract test of the vLLM proposer against vLLM 0.33.0's ``custom_class`` interface (vLLM is not installed: it needs CUDA wheels).

What vLLM 0.33.0 (the last release with ``custom_class``; read from its wheel) does, and this
test does the same way:

- ``SpeculativeConfig``: ``method="custom_class"`` (or left out: inferred from a dotted path in
  ``model``), ``model="pkg.Class"``, ``num_speculative_tokens``; the class is imported from
  ``model`` and built as ``Class(vllm_config)``, which must have a callable ``propose``
  (``vllm/v1/spec_decode/custom_class_proposer.py``, ``create_custom_proposer``).
- ``GPUModelRunner.propose_draft_token_ids`` calls ``drafter.propose(sampled_token_ids,
  input_batch.num_tokens_no_spec, input_batch.token_ids_cpu, slot_mappings=...)`` after the
  sampled tokens were written into ``token_ids_cpu`` and counted in ``num_tokens_no_spec``:
  ``token_ids_cpu`` is int32 [max_num_reqs, max_model_len], ``num_tokens_no_spec`` int32
  [max_num_reqs], ``sampled_token_ids`` a list (one per row in the batch) of lists, empty for a
  row that sampled nothing; rows are reused, compacted (``condense``) and swapped.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import numpy as np
import pytest

from ngramcache import UNTAGGED, Drafter, StaticCache, build_static_from_tokens
from ngramcache.client.adapters.batch_rows import BatchRows
from ngramcache.client.adapters.vllm import NgramCacheProposer, ProposerConfig
from ngramcache.client.kernel.errors import InvalidArgumentError, TokenizerMismatchError

BACKEND = "ngramcache.client.adapters.vllm.NgramCacheProposer"
VOCAB = 200
MAX_REQS = 6
MAX_LEN = 96
SPEC_TOKENS = 4


def vllm_config(num_speculative_tokens: int | None = SPEC_TOKENS, max_model_len: int = MAX_LEN,
                max_num_seqs: int = MAX_REQS) -> SimpleNamespace:
    """The parts of a vLLM 0.33.0 VllmConfig the proposer reads, with their names and types there."""
    return SimpleNamespace(
        speculative_config=SimpleNamespace(method="custom_class", model=BACKEND,
                                           num_speculative_tokens=num_speculative_tokens),
        model_config=SimpleNamespace(max_model_len=max_model_len, tokenizer=None, get_vocab_size=lambda: VOCAB),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
    )


def load_like_vllm(config: SimpleNamespace) -> NgramCacheProposer:
    """What create_custom_proposer does: import the dotted path, build it with the config, check `propose`."""
    module_path, class_name = config.speculative_config.model.rsplit(".", 1)
    cls = getattr(importlib.import_module(module_path), class_name)
    proposer = cls(config)
    assert callable(proposer.propose)
    return proposer


class PersistentBatch:
    """vLLM's InputBatch as the proposer sees it: rows of token ids, added, grown, removed, compacted."""

    def __init__(self) -> None:
        self.token_ids_cpu = np.zeros((MAX_REQS, MAX_LEN), dtype=np.int32)
        self.num_tokens_no_spec = np.zeros(MAX_REQS, dtype=np.int32)
        self.req_ids: list[str | None] = []

    def add(self, req_id: str, tokens: list[int]) -> int:
        row = self.req_ids.index(None) if None in self.req_ids else len(self.req_ids)
        if row == len(self.req_ids):
            self.req_ids.append(None)
        self.req_ids[row] = req_id
        self.token_ids_cpu[row, : len(tokens)] = tokens
        self.num_tokens_no_spec[row] = len(tokens)
        return row

    def remove(self, req_id: str) -> list[int]:
        row = self.req_ids.index(req_id)
        self.req_ids[row] = None
        tokens = self.tokens(row).tolist()
        self.token_ids_cpu[row] = 0  # vLLM leaves stale ids; zeroes make a reused row's prefix differ all the same
        self.num_tokens_no_spec[row] = 0
        return tokens

    def condense(self) -> None:
        """Moves the last requests into the holes, as vLLM compacts its batch after removals."""
        while None in self.req_ids:
            hole = self.req_ids.index(None)
            last = len(self.req_ids) - 1
            if hole != last:
                self.req_ids[hole] = self.req_ids[last]
                self.token_ids_cpu[hole] = self.token_ids_cpu[last]
                self.num_tokens_no_spec[hole] = self.num_tokens_no_spec[last]
            self.req_ids.pop()

    def swap(self, i: int, j: int) -> None:
        self.req_ids[i], self.req_ids[j] = self.req_ids[j], self.req_ids[i]
        self.token_ids_cpu[[i, j]] = self.token_ids_cpu[[j, i]]
        self.num_tokens_no_spec[[i, j]] = self.num_tokens_no_spec[[j, i]]

    def tokens(self, row: int) -> np.ndarray:
        return self.token_ids_cpu[row, : self.num_tokens_no_spec[row]]

    def sample(self, row: int, tokens: list[int]) -> list[int]:
        n = int(self.num_tokens_no_spec[row])
        self.token_ids_cpu[row, n: n + len(tokens)] = tokens
        self.num_tokens_no_spec[row] = n + len(tokens)
        return tokens


def step(proposer: NgramCacheProposer, batch: PersistentBatch, sampled: dict[int, list[int]]) -> list[list[int]]:
    """One model-runner step: sampled tokens are written into the rows, then `propose` is called as vLLM calls it."""
    lists = [batch.sample(r, sampled[r]) if r in sampled else [] for r in range(len(batch.req_ids))]
    drafts = proposer.propose(lists, batch.num_tokens_no_spec, batch.token_ids_cpu, slot_mappings=None)
    assert isinstance(drafts, list) and len(drafts) == len(batch.req_ids)
    assert all(isinstance(d, list) and all(type(t) is int for t in d) for d in drafts)
    return drafts


def reference(static_path: str | None, tokens: np.ndarray, n: int) -> list[int]:
    """What a plain Drafter drafts for the same sequence."""
    ref = Drafter(StaticCache.open(static_path)) if static_path else Drafter(fingerprint=UNTAGGED, vocab_size=VOCAB)
    ref.accept(0, np.ascontiguousarray(tokens, dtype=np.int32))
    return [int(t) for t in ref.draft(0, np.ascontiguousarray(tokens, dtype=np.int32), n)]


PATTERN = [11, 12, 13, 14, 15, 16, 17, 18]


@pytest.fixture
def static_file(tmp_path):
    path = tmp_path / "gen.ngc"
    rng = np.random.default_rng(5)
    streams = [np.array(PATTERN * 20, dtype=np.int32), rng.integers(20, 100, 400).astype(np.int32)]
    build_static_from_tokens(streams, path, VOCAB, fingerprint=UNTAGGED)
    return str(path)


def test_loaded_and_called_as_vllm_does(static_file):
    proposer = load_like_vllm_with(static_file)
    batch = PersistentBatch()
    batch.add("a", [11, 12, 13])
    drafts = step(proposer, batch, {0: [14]})
    assert drafts[0] == reference(static_file, batch.tokens(0), SPEC_TOKENS) == [15, 16, 17, 18]
    proposer.close()


def load_like_vllm_with(static_path: str | None, **env: str) -> NgramCacheProposer:
    # The compatible mode: its drafts depend on the sequence alone, so each row's can be checked on its own.
    values = {"NGC_VLLM_STATIC": static_path or "", "NGC_VLLM_MODE": "compatible", **env}
    return NgramCacheProposer(vllm_config(), ProposerConfig.from_env(values))


def test_requests_admitted_preempted_finished_and_rows_reused(static_file):
    proposer = load_like_vllm_with(static_file)
    drafter = proposer.drafter
    batch = PersistentBatch()
    rng = np.random.default_rng(7)
    for name in "abc":
        batch.add(name, [int(t) for t in rng.integers(20, VOCAB, 5)] + [11, 12])
    # Step 1: b is still prefilling (samples nothing), a and c draft.
    drafts = step(proposer, batch, {0: [13], 2: [13]})
    assert drafts[1] == []
    for r in (0, 2):
        assert drafts[r] == reference(static_file, batch.tokens(r), SPEC_TOKENS) != []
    assert proposer.rows.started == 2
    # Step 2: every row samples (a accepted 2 drafted tokens and one more).
    drafts = step(proposer, batch, {0: [14, 15, 16], 1: [13], 2: [99]})
    for r in range(3):
        assert drafts[r] == reference(static_file, batch.tokens(r), SPEC_TOKENS)
    assert proposer.rows.started == 3 and proposer.stats.accepted == 2
    # a is preempted (leaves the batch), the batch is compacted: c moves from row 2 to row 0.
    a_tokens = batch.remove("a")
    batch.condense()
    assert batch.req_ids == ["c", "b"]
    drafts = step(proposer, batch, {0: [11], 1: [14]})
    for r in range(2):
        assert drafts[r] == reference(static_file, batch.tokens(r), SPEC_TOKENS)
    assert proposer.rows.started == 3 and proposer.rows.taken_over == 1 and proposer.rows.parked == 1
    # a comes back in another row, with the tokens it had: its sequence continues, nothing is recounted.
    row = batch.add("a", a_tokens)
    assert row == 2
    batch.swap(0, 1)
    drafts = step(proposer, batch, {0: [15], 1: [12], 2: [17]})
    for r in range(3):
        assert drafts[r] == reference(static_file, batch.tokens(r), SPEC_TOKENS)
    assert proposer.rows.started == 3 and proposer.rows.parked == 0
    # c finishes and a new request d gets its row: a new sequence, counted from its first token.
    c_row = batch.req_ids.index("c")
    batch.remove("c")
    d_row = batch.add("d", [11, 12, 13, 14, 15])
    assert d_row == c_row
    before = drafter.n_sequences  # type: ignore[attr-defined]
    drafts = step(proposer, batch, {d_row: [16]} | {r: [18] for r in range(3) if r != d_row})
    for r in range(3):
        assert drafts[r] == reference(static_file, batch.tokens(r), SPEC_TOKENS)
    assert proposer.rows.started == 4 and proposer.rows.parked == 1
    assert drafter.n_sequences == before + 1  # type: ignore[attr-defined]
    proposer.close()
    assert drafter.n_sequences == 0  # type: ignore[attr-defined]


def test_finished_sequences_are_freed_beyond_the_parking_bound():
    drafter = Drafter(fingerprint=UNTAGGED, vocab_size=VOCAB)
    rows = BatchRows(drafter, max_parked=1)
    toks = [np.array([5, 6, 7, i], dtype=np.int32) for i in range(3)]
    rows.assign([0, 1, 2], toks)
    assert drafter.n_sequences == 3
    rows.assign([0], [toks[0]])  # rows 1 and 2 finished: one stays parked, the older beyond the bound goes
    assert (rows.parked, rows.freed, drafter.n_sequences) == (1, 1, 2)
    idle = BatchRows(drafter, first_seq_id=100, max_parked=10, max_idle_steps=2)
    idle.assign([0, 1], [np.array([1, 2], dtype=np.int32), np.array([3, 4], dtype=np.int32)])
    idle.assign([0], [np.array([1, 2, 3], dtype=np.int32)])
    assert idle.parked == 1
    idle.assign([0], [np.array([1, 2, 3, 4], dtype=np.int32)])
    assert (idle.parked, idle.freed) == (0, 1)


def test_a_moved_request_keeps_its_sequence_while_a_new_one_prefills_in_its_old_row():
    drafter = Drafter(fingerprint=UNTAGGED, vocab_size=VOCAB)
    rows = BatchRows(drafter)
    a, b = np.array([1, 2, 3], dtype=np.int32), np.array([7, 8, 9], dtype=np.int32)
    first = rows.assign([0, 1], [a, b])
    # b moved to row 0 and grew; row 1 now holds a new request still prefilling (nothing sampled).
    again = rows.assign([0], [np.array([7, 8, 9, 10], dtype=np.int32)], held=[1])
    assert again[0] is first[1] and rows.started == 2 and rows.taken_over == 1
    assert rows.parked == 1  # a: out of the batch, kept


def test_no_draft_is_an_empty_list_and_drafts_stop_at_max_model_len(static_file):
    proposer = NgramCacheProposer(vllm_config(max_model_len=10), ProposerConfig(static=static_file, mode="compatible"))
    batch = PersistentBatch()
    batch.add("x", [150, 151, 152])  # never seen: nothing to draft
    batch.add("y", [11, 12, 13, 14, 15, 16, 17])
    drafts = step(proposer, batch, {0: [153], 1: [18]})
    assert drafts[0] == []
    assert drafts[1] == [11, 12]  # 8 tokens of 10: two more at most
    assert step(proposer, batch, {})[:2] == [[], []]  # nothing sampled: nothing drafted
    proposer.close()


def test_context_only_without_a_static_file_drafts_as_a_plain_drafter():
    proposer = load_like_vllm(vllm_config())
    batch = PersistentBatch()
    prompt = [30, 31, 32, 33, 34, 35, 30, 31]
    batch.add("p", prompt)
    drafts = step(proposer, batch, {0: [32]})
    assert drafts[0] == reference(None, batch.tokens(0), SPEC_TOKENS) != []


def test_n_draft_is_bounded_by_num_speculative_tokens(static_file):
    config = ProposerConfig.from_env({"NGC_VLLM_STATIC": static_file, "NGC_VLLM_N_DRAFT": "2"})
    assert NgramCacheProposer(vllm_config(), config).n_draft == 2
    config = ProposerConfig.from_env({"NGC_VLLM_STATIC": static_file, "NGC_VLLM_N_DRAFT": "50"})
    assert NgramCacheProposer(vllm_config(), config).n_draft == SPEC_TOKENS


@pytest.mark.parametrize(("env", "message"), [
    ({"NGC_VLLM_MODE": "fast"}, "NGC_VLLM_MODE must be 'compatible' or 'match'"),
    ({"NGC_VLLM_N_DRAFT": "eight"}, "NGC_VLLM_N_DRAFT must be a whole number"),
    ({"NGC_VLLM_N_DRAFT": "0"}, "NGC_VLLM_N_DRAFT must be in 1..256"),
    ({"NGC_VLLM_SERVICE": "localhost:1"}, "NGC_VLLM_SERVICE needs NGC_VLLM_NAMESPACE"),
    ({"NGC_VLLM_REMOTE": "1"}, "NGC_VLLM_REMOTE=1 needs NGC_VLLM_SERVICE"),
    ({"NGC_VLLM_REMOTE": "yes"}, "NGC_VLLM_REMOTE must be 0 or 1"),
    ({"NGC_VLLM_STATIC": "/a.ngc", "NGC_VLLM_SERVICE": "h:1", "NGC_VLLM_NAMESPACE": "n"}, "not both"),
    ({"NGC_VLLM_TLS_CA": "/ca.pem"}, "NGC_VLLM_TLS_CA needs NGC_VLLM_SERVICE"),
    ({"NGC_VLLM_SERVICE": "h:1", "NGC_VLLM_NAMESPACE": "n", "NGC_VLLM_TLS_CA": "/ca.pem", "NGC_VLLM_TLS_CERT": "/c.pem"},
     "NGC_VLLM_TLS_CERT and NGC_VLLM_TLS_KEY go together"),
    ({"NGC_VLLM_SERVICE": "h:1", "NGC_VLLM_NAMESPACE": "n", "NGC_VLLM_TLS_CERT": "/c.pem", "NGC_VLLM_TLS_KEY": "/k.pem"},
     "NGC_VLLM_TLS_CERT and NGC_VLLM_TLS_KEY .* need NGC_VLLM_TLS_CA"),
])
def test_bad_settings_are_refused_clearly(env, message):
    with pytest.raises(InvalidArgumentError, match=message):
        ProposerConfig.from_env(env)


def test_bad_vllm_config_or_static_path_is_refused_clearly(tmp_path):
    with pytest.raises(InvalidArgumentError, match="num_speculative_tokens"):
        NgramCacheProposer(vllm_config(num_speculative_tokens=None), ProposerConfig())
    with pytest.raises(InvalidArgumentError, match="num_speculative_tokens"):
        NgramCacheProposer(SimpleNamespace(), ProposerConfig())
    with pytest.raises(InvalidArgumentError, match="is not a file"):
        NgramCacheProposer(vllm_config(), ProposerConfig(static=str(tmp_path / "missing.ngc")))


def test_a_static_file_of_another_tokenizer_is_refused(static_file):
    config = ProposerConfig(static=static_file, tokenizer="tiktoken:qwen")  # the file is untagged (raw ids)
    with pytest.raises(TokenizerMismatchError):
        NgramCacheProposer(vllm_config(), config)


def test_tls_settings_are_read_from_the_environment():
    config = ProposerConfig.from_env({"NGC_VLLM_SERVICE": "h:1", "NGC_VLLM_NAMESPACE": "n", "NGC_VLLM_TLS_CA": "/ca.pem",
                                      "NGC_VLLM_TLS_CERT": "/c.pem", "NGC_VLLM_TLS_KEY": "/k.pem"})
    assert (config.tls_ca, config.tls_cert, config.tls_key) == ("/ca.pem", "/c.pem", "/k.pem")
    assert ProposerConfig.from_env({}).tls_ca is None


@pytest.mark.parametrize(("per_token", "full"), [(0.002, True), (1.0, False)])
def test_auto_draft_length_follows_the_step_costs_it_measures(static_file, per_token, full):
    """NGC_VLLM_N_DRAFT=auto: the time between two calls is one engine step that verified the
    drafts of the first, and the costs are learned from those steps: a drafted token nearly free
    (a GPU) or costing a whole step (a few CPU cores). Either way this sure copy is drafted full
    length: where long drafts are cheap the policy keeps it, where they are dear the drafter's
    own draft is sent whole, as a fixed length does (costs learned on a loaded CPU cut worse)."""
    spec, max_len = 8, 4096
    config = ProposerConfig.from_env({"NGC_VLLM_STATIC": static_file, "NGC_VLLM_N_DRAFT": "auto"})
    proposer = NgramCacheProposer(vllm_config(num_speculative_tokens=spec, max_model_len=max_len), config)
    assert proposer.step_costs is not None and proposer.n_draft == spec
    clock = [0.0]
    proposer.clock = lambda: clock[0]
    token_ids = np.zeros((1, max_len), dtype=np.int32)
    n = 3
    token_ids[0, :n] = PATTERN[:n]
    drafts: list[int] = []
    lengths = []
    for _ in range(300):
        # The model agrees with every drafted token (they follow the pattern) and samples one more.
        sampled = [PATTERN[(n + i) % len(PATTERN)] for i in range(len(drafts) + 1)]
        token_ids[0, n: n + len(sampled)] = sampled
        n += len(sampled)
        if n + spec + 1 >= max_len:
            break
        clock[0] += 0.025 * (1.0 + per_token * len(drafts))  # the step that verified `drafts`
        drafts = proposer.propose([sampled], np.array([n], dtype=np.int32), token_ids)[0]
        assert drafts == [PATTERN[(n + i) % len(PATTERN)] for i in range(len(drafts))]
        lengths.append(len(drafts))
    assert proposer.step_costs.measured
    assert 0 in lengths  # steps without a draft timed the baseline
    recent = lengths[-20:]
    assert max(recent) == spec
    if full:
        assert proposer.step_costs(spec) < 1.1
    else:
        assert proposer.step_costs(spec) > 8.0
    proposer.close()


def test_auto_is_read_from_the_environment_and_bad_values_are_refused():
    assert ProposerConfig.from_env({"NGC_VLLM_N_DRAFT": "auto"}).n_draft == "auto"
    with pytest.raises(InvalidArgumentError, match="NGC_VLLM_N_DRAFT must be 'auto' or a whole number"):
        ProposerConfig(n_draft="fast")


def test_the_default_match_mode_copies_to_the_width(static_file):
    """By default (the match mode) a copy is not cut at its match length: vLLM verifies the width anyway."""
    proposer = NgramCacheProposer(vllm_config(), ProposerConfig(static=static_file))
    assert proposer.config.mode == "match"
    batch = PersistentBatch()
    batch.add("a", [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 30, 31, 32])
    drafts = step(proposer, batch, {0: [33]})
    ref = Drafter(StaticCache.open(static_file), mode="match")
    tokens = np.ascontiguousarray(batch.tokens(0), dtype=np.int32)
    ref.accept(0, tokens)
    assert drafts[0] == ref.draft_scored(0, tokens, SPEC_TOKENS, uncapped=True)[0].tolist() == [34, 35, 36, 37]
    proposer.close()
