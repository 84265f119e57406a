"""Contract test of the ``ngramcache`` speculative method against vLLM 0.34.0's interface (vLLM is not installed: it needs CUDA wheels).

vLLM 0.34.0 (the newest on the package index on 2026-12-04; read from its wheel) removed
``custom_class`` with its V1 model runner. An external drafter is a ``BaseSpeculator`` named by
the ``speculator_class`` of a ``SpeculatorConfig`` that a ``vllm.general_plugins`` entry point
registers with ``register_speculative_method`` in every process; ``method: "ngramcache"`` then
selects it. `helpers.vllm_stand_in` reproduces those parts of vLLM (module paths, names,
signatures, checks, and what the model runner does around ``propose``), and this test goes
through them as vLLM does: the entry point named in pyproject.toml, the config set up by
``SpeculativeConfig.__post_init__``'s steps, the speculator built by ``init_speculator``, steps
run as ``sample_tokens`` runs them. Every draft is checked against a plain `Drafter`'s.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from helpers import vllm_stand_in  # noqa: E402

from ngramcache import UNTAGGED, Drafter, StaticCache, build_static_from_tokens  # noqa: E402
from ngramcache.cache_service.toml_files import tomllib  # noqa: E402
from ngramcache.client.kernel.errors import InvalidArgumentError  # noqa: E402

VOCAB = 200
MAX_REQS = 4
MAX_LEN = 128
PATTERN = [11, 12, 13, 14, 15, 16, 17, 18]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def vllm(monkeypatch):
    """vLLM 0.34.0's modules (the stand-in) in sys.modules; the adapter modules bound to them dropped after."""
    for name in vllm_stand_in.vllm_modules():
        monkeypatch.delitem(sys.modules, name, raising=False)
    for name, module in vllm_stand_in.install().items():
        monkeypatch.setitem(sys.modules, name, module)
    yield vllm_stand_in
    for name in vllm_stand_in.vllm_modules():
        sys.modules.pop(name, None)


@pytest.fixture
def static_file(tmp_path):
    path = tmp_path / "gen.ngc"
    rng = np.random.default_rng(5)
    streams = [np.array(PATTERN * 20, dtype=np.int32), rng.integers(20, 100, 400).astype(np.int32)]
    build_static_from_tokens(streams, path, VOCAB, fingerprint=UNTAGGED)
    return str(path)


def load_plugins() -> None:
    """What vLLM's load_general_plugins does with this package's ``vllm.general_plugins`` entry point
    (read from pyproject.toml: the metadata of an editable install may predate it): load it, call it."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        points = tomllib.load(f)["project"]["entry-points"]["vllm.general_plugins"]
    assert points == {"ngramcache": "ngramcache.client.adapters.vllm:register"}
    for name, value in points.items():
        importlib.metadata.EntryPoint(name, value, "vllm.general_plugins").load()()


def vllm_config(vllm, *, num_speculative_tokens=None, options=None, adaptive=False, tp=1, max_model_len=MAX_LEN):
    """A VllmConfig with the method "ngramcache" set up as vLLM 0.34.0 sets it up."""
    model_config = SimpleNamespace(max_model_len=max_model_len, tokenizer=None, get_vocab_size=lambda: VOCAB)
    parallel_config = SimpleNamespace(tensor_parallel_size=tp)
    spec = vllm.speculative_config(model_config, parallel_config, method="ngramcache",
                                   num_speculative_tokens=num_speculative_tokens, speculator_options=options,
                                   enable_adaptive_verification=adaptive)
    return SimpleNamespace(speculative_config=spec, model_config=model_config, parallel_config=parallel_config,
                           scheduler_config=SimpleNamespace(max_num_seqs=MAX_REQS))


def reference(static_path, tokens, n):
    """What a plain Drafter drafts for the same sequence."""
    ref = Drafter(StaticCache.open(static_path)) if static_path else Drafter(fingerprint=UNTAGGED, vocab_size=VOCAB)
    toks = np.asarray(tokens, dtype=np.int32)
    ref.accept(0, toks)
    return [int(t) for t in ref.draft(0, toks, n)]


def expect(static_path, tokens, width, k=None):
    """The row vLLM gets: the reference draft, then the row's last token as filler, -1 past this step's width `k`."""
    k = width if k is None else k
    draft = reference(static_path, tokens, k)
    return (draft + [tokens[-1]] * (k - len(draft)) + [-1] * (width - k))


def test_the_entry_point_registers_the_method_and_vllm_builds_the_speculator(vllm, static_file):
    with pytest.raises(ValueError, match="Unknown speculative method 'ngramcache'"):
        vllm_config(vllm)
    load_plugins()
    load_plugins()  # every vLLM process loads it; again is harmless
    assert vllm.registered_speculative_methods() == ["ngramcache"]
    config = vllm_config(vllm, options={"static": static_file, "mode": "compatible"})
    spec = config.speculative_config
    assert (spec.custom_method, spec.method, spec.num_speculative_tokens) == ("ngramcache", None, 8)
    assert spec.draft_model_config is config.model_config  # no draft model
    runner = vllm.ModelRunner(config)
    from ngramcache.client.adapters.vllm_speculator import NgramCacheSpeculator

    assert type(runner.speculator) is NgramCacheSpeculator
    runner.add_request("a", [11, 12, 13])
    drafts = runner.step({"a": [14]}, ["a"])
    assert drafts["a"] == expect(static_file, [11, 12, 13, 14], 8) == [15, 16, 17, 18, 11, 12, 13, 14]
    runner.speculator.close()


def test_requests_prefill_preempt_resume_and_finish(vllm, static_file):
    load_plugins()
    runner = vllm.ModelRunner(vllm_config(vllm, num_speculative_tokens=4, options={"static": static_file, "mode": "compatible"}))
    sp = runner.speculator
    rng = np.random.default_rng(7)
    prompts = {r: [int(t) for t in rng.integers(20, VOCAB, 5)] + [11, 12] for r in "abc"}
    for r in "abc":
        runner.add_request(r, prompts[r])
    # Step 1: b is a prefill chunk not finished (samples nothing): its row holds no draft.
    drafts = runner.step({"a": [13], "c": [13]}, ["a", "b", "c"])
    assert drafts["b"] == [0, 0, 0, 0]
    for r in "ac":
        assert drafts[r] == expect(static_file, runner.req_states.tokens(r), 4)
    assert sp.drafter.n_sequences == 2
    # Step 2: a accepted three drafted tokens and sampled one more; the batch order changed.
    drafts = runner.step({"a": [14, 15, 16, 17], "b": [13], "c": [99]}, ["c", "a", "b"])
    for r in "abc":
        assert drafts[r] == expect(static_file, runner.req_states.tokens(r), 4)
    assert (sp.stats.accepted, sp.drafter.n_sequences) == (3, 3)
    # a is preempted (its slot freed) and resumes in another slot with its prompt and outputs:
    # its sequence continues (nothing recounted), read whole once.
    a_tokens = runner.req_states.tokens("a")
    a_slot = runner.req_states.req_id_to_index["a"]
    runner.finish_requests(set(), preempted={"a"})
    runner.add_request("d", [30, 31, 32])  # takes a's old slot
    assert runner.req_states.req_id_to_index["d"] == a_slot
    drafts = runner.step({"b": [14], "c": [11], "d": [33]}, ["b", "c", "d"])
    for r in "bcd":
        assert drafts[r] == expect(static_file, runner.req_states.tokens(r), 4)
    seq_a = sp._seqs["a"]
    runner.add_request("a", a_tokens[:7], prefill=a_tokens)
    drafts = runner.step({"a": [18], "b": [15], "c": [12], "d": [34]}, ["a", "b", "c", "d"])
    for r in "abcd":
        assert drafts[r] == expect(static_file, runner.req_states.tokens(r), 4)
    assert sp._seqs["a"] is seq_a and sp.drafter.n_sequences == 4
    # c finishes: its sequence is freed before its slot is.
    runner.finish_requests({"c"})
    assert sp.drafter.n_sequences == 3 and "c" not in sp._seqs
    sp.close()
    assert sp.drafter.n_sequences == 0


def test_a_slot_reused_by_a_new_request_starts_a_new_sequence(vllm):
    load_plugins()
    runner = vllm.ModelRunner(vllm_config(vllm, num_speculative_tokens=4))  # context only: no static file
    runner.add_request("x", [40, 41, 42, 43, 40, 41])
    drafts = runner.step({"x": [42]}, ["x"])
    assert drafts["x"] == expect(None, runner.req_states.tokens("x"), 4)
    runner.finish_requests({"x"})
    runner.add_request("y", [40, 41, 50, 51, 40, 41])  # same slot, other tokens
    drafts = runner.step({"y": [50]}, ["y"])
    assert drafts["y"] == expect(None, runner.req_states.tokens("y"), 4) == [51, 40, 41, 50]


def test_this_steps_width_dummy_runs_and_warmup_requests(vllm, static_file):
    load_plugins()
    runner = vllm.ModelRunner(vllm_config(vllm, num_speculative_tokens=4, options={"static": static_file, "mode": "compatible"}))
    sp = runner.speculator
    runner.add_request("r", [11, 12, 13])
    # Dynamic speculative decoding chose 2 slots this step: the rest is -1 (vLLM sets it).
    assert runner.step({"r": [14]}, ["r"], num_spec_tokens=2) == {"r": [15, 16, -1, -1]}
    # A step that skips drafts, and a dummy run: nothing drafted, nothing counted.
    drafted = sp.stats.drafted
    runner.step({"r": [15]}, ["r"], num_spec_tokens=0)
    runner.step({}, ["r"], dummy_run=True)
    assert sp.stats.drafted == drafted
    assert runner.step({}, ["r"]) == {"r": [0, 0, 0, 0]}  # nothing sampled (a prefill chunk): no draft
    runner.finish_requests({"r"})
    # vLLM's warmup requests (synthetic ids) are neither drafted for nor learned from.
    runner.add_request("_warmup_0_", list(range(5)))
    drafts = runner.step({"_warmup_0_": [5]}, ["_warmup_0_"])
    assert drafts["_warmup_0_"] == [0, 0, 0, 0] and "_warmup_0_" not in sp._seqs
    runner.finish_requests({"_warmup_0_"})
    sp.reset_state()
    assert sp.drafter.n_sequences == 0


def test_max_model_len_bounds_the_drafted_tokens(vllm, static_file):
    load_plugins()
    runner = vllm.ModelRunner(vllm_config(vllm, num_speculative_tokens=4, options={"static": static_file, "mode": "compatible"},
                                          max_model_len=10))
    runner.add_request("r", [11, 12, 13, 14, 15, 16, 17])
    assert runner.step({"r": [18]}, ["r"]) == {"r": [11, 12, 18, 18]}  # 8 tokens of 10: two drafted, fillers after


def test_adaptive_verification_gets_the_drafters_odds(vllm, static_file):
    load_plugins()
    runner = vllm.ModelRunner(vllm_config(vllm, num_speculative_tokens=6, options={"static": static_file, "mode": "compatible"},
                                          adaptive=True))
    sp = runner.speculator
    assert sp.enable_adaptive_verification and sp.draft_token_confidence_probs.shape == (MAX_REQS, 6)
    runner.add_request("r", [11, 12, 13])
    drafts = runner.step({"r": [14]}, ["r"])
    ref = Drafter(StaticCache.open(static_file))
    toks = np.array([11, 12, 13, 14], dtype=np.int32)
    ref.accept(0, toks)
    want, odds = ref.draft_scored(0, toks, 6)
    assert drafts["r"][: len(want)] == want.tolist()
    slot = runner.req_states.req_id_to_index["r"]
    got = sp.draft_token_confidence_probs[0].tolist()  # batch row 0 (vLLM scatters it by idx_mapping)
    assert got[: len(odds)] == pytest.approx(odds.tolist()) and all(0 < p <= 1 for p in got[: len(odds)])
    assert got[len(odds):] == [0.0] * (6 - len(odds))  # fillers: trimmed first
    assert slot >= 0


@pytest.mark.parametrize(("options", "message"), [
    ({"satic": "/a.ngc"}, "speculator_options: unknown option 'satic'"),
    ({"token": "s3cret"}, "give the bearer token in NGC_VLLM_TOKEN"),
    ({"n_draft": "8"}, "n_draft must be 'auto' or a whole number"),
    ({"remote": "yes"}, "remote must be true or false"),
    ({"service": "h:1"}, r"speculator_options \(over NGC_VLLM_\*\): NGC_VLLM_SERVICE needs NGC_VLLM_NAMESPACE"),
    ({"mode": "fast"}, "NGC_VLLM_MODE must be 'compatible' or 'match'"),
])
def test_bad_options_stop_vllm_while_it_reads_its_config(vllm, options, message):
    load_plugins()
    with pytest.raises(InvalidArgumentError, match=message):
        vllm_config(vllm, options=options)


def test_options_override_the_environment(monkeypatch, static_file):
    from ngramcache.client.adapters.vllm import ProposerConfig

    env = {"NGC_VLLM_MODE": "match", "NGC_VLLM_N_DRAFT": "3", "NGC_VLLM_STATIC": "/elsewhere.ngc"}
    config = ProposerConfig.from_options({"static": static_file, "n_draft": "auto", "service": []}, env)
    assert (config.static, config.mode, config.n_draft, config.service) == (static_file, "match", "auto", ())
    config = ProposerConfig.from_options({"service": "h:1, h:2", "namespace": "code", "remote": True}, {})
    assert (config.service, config.remote) == (("h:1", "h:2"), True)


def test_a_service_with_tensor_parallelism_is_refused(vllm):
    load_plugins()
    config = vllm_config(vllm, options={"service": "127.0.0.1:1", "namespace": "code", "tokenizer": "tiktoken:qwen"},
                         tp=2)
    with pytest.raises(InvalidArgumentError, match="NGC_VLLM_SERVICE with tensor_parallel_size 2: each rank drafts"):
        vllm.ModelRunner(config)


def test_without_vllm_0_34_register_does_nothing_and_the_speculator_says_what_it_needs(monkeypatch):
    from ngramcache.client.adapters.vllm import register

    for name in vllm_stand_in.vllm_modules():
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "vllm", None)  # no vLLM (or one without custom speculative methods)
    assert register() is None
    with pytest.raises(ImportError, match="needs vLLM 0.34 or later"):
        importlib.import_module("ngramcache.client.adapters.vllm_speculator")
    sys.modules.pop("ngramcache.client.adapters.vllm_speculator", None)
