"""The transformers adapter on a real model (SmolLM2-135M): the same output as plain greedy generate(), with drafts accepted."""

from __future__ import annotations

import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch
from helpers.drafters import NoOddsDrafter
from helpers.model import (
    PROMPT_FUNCTIONS,
    chatml,
    load_transformers_model,
    repeat_prompt,
    stdlib_function_source,
    stdlib_module_sources,
)
from helpers.service import ServiceThread

from ngramcache import (
    UNTAGGED,
    CountTable,
    Drafter,
    InvalidArgumentError,
    RemoteDrafter,
    StaticCache,
    build_static_from_tokens,
    load_tokenizer,
)
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc
from ngramcache.client.adapters.transformers import (
    DraftStats,
    NgramCandidateGenerator,
    generate,
    learned_verify_cost,
    measure_verify_cost,
    ngram_decoding,
)

pytestmark = [pytest.mark.integration, pytest.mark.engine]

NEW_TOKENS = 48


@pytest.fixture(scope="module")
def smollm2():
    return load_transformers_model()


@pytest.fixture(scope="module")
def ngc_tokenizer(smollm2, tmp_path_factory):
    """ngramcache's Tokenizer for the model's vocabulary: the GGUF's tokenizer saved as tokenizer.json."""
    _, tok = smollm2
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tok.backend_tokenizer.save(str(path))
    return load_tokenizer(str(path))


@pytest.fixture(scope="module")
def static_cache(ngc_tokenizer, tmp_path_factory):
    """A static cache built with ngramcache's API from stdlib modules tokenized with the model's tokenizer."""
    path = tmp_path_factory.mktemp("static") / "stdlib.ngc"
    streams = ngc_tokenizer.encode_batch(stdlib_module_sources())
    build_static_from_tokens(streams, path, vocab_size=ngc_tokenizer.vocab_size,
                             fingerprint=ngc_tokenizer.fingerprint, generation=1)
    return StaticCache.open(path)


def assert_counted_once(drafter, seq: int, tokens: torch.Tensor) -> None:
    """The drafter's context table of `seq` is that of `tokens` counted in one go."""
    expected = CountTable()
    expected.update(tokens.numpy().astype(np.int32))
    assert expected.n_entries > 0
    assert sorted(map(tuple, drafter.context_rows(seq).tolist())) == sorted(map(tuple, expected.to_rows().tolist()))


def prompt_ids(tok, spec: str) -> torch.Tensor:
    text = chatml(repeat_prompt(stdlib_function_source(spec)))
    return tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def plain_outputs(smollm2):
    """Plain greedy generate() of every prompt: the reference."""
    model, tok = smollm2
    out = {}
    for spec in PROMPT_FUNCTIONS:
        ids = prompt_ids(tok, spec)
        out[spec] = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("spec", PROMPT_FUNCTIONS)
def test_output_equals_plain_greedy_and_drafts_are_accepted(smollm2, static_cache, plain_outputs, spec):
    model, tok = smollm2
    ids = prompt_ids(tok, spec)
    drafter = Drafter(static=static_cache, dynamic=CountTable())
    assert drafter.vocab_size >= model.config.vocab_size
    stats = DraftStats()

    out = generate(model, ids, drafter, seq_id=7, n_draft=8, max_new_tokens=NEW_TOKENS, stats=stats)

    assert torch.equal(out, plain_outputs[spec]), (tok.decode(out[0, ids.shape[1]:]), tok.decode(plain_outputs[spec][0, ids.shape[1]:]))
    assert out.shape[1] - ids.shape[1] >= 32
    assert stats.tokens == out.shape[1] - ids.shape[1]
    assert stats.accepted > 0 and stats.drafted >= stats.accepted
    # Every accepted token saved a forward pass: steps + accepted = new tokens.
    assert stats.steps + stats.accepted == stats.tokens
    assert stats.forward_passes_per_token < 1.0
    # After each verification the drafter accepted the new sequence, each token once.
    assert_counted_once(drafter, 7, out[0])


@pytest.mark.slow
def test_match_mode_output_equals_plain_greedy(smollm2, static_cache, plain_outputs):
    """The adapters take the mode of the drafter they are given: the match mode verifies the same."""
    model, tok = smollm2
    spec = PROMPT_FUNCTIONS[0]
    ids = prompt_ids(tok, spec)
    drafter = Drafter(static=static_cache, dynamic=CountTable(), mode="match")
    stats = DraftStats()
    out = generate(model, ids, drafter, seq_id=3, n_draft=8, max_new_tokens=NEW_TOKENS, stats=stats)
    assert torch.equal(out, plain_outputs[spec])
    assert stats.accepted > 0 and stats.steps + stats.accepted == stats.tokens


class StaticOnly:
    """A drafter that never counts the sequence: its drafts come from the static cache alone."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter

    def draft(self, seq, tokens, n_draft=8):
        return self.drafter.draft(seq, tokens, n_draft)

    def accept(self, seq, tokens):
        pass

    def reset(self, seq):
        return self.drafter.reset(seq)


@pytest.mark.slow
def test_static_cache_alone_gets_drafts_accepted(smollm2, static_cache, plain_outputs):
    """A drafter whose only counts are the static cache of other files: still the same output."""
    model, tok = smollm2
    spec = PROMPT_FUNCTIONS[0]
    ids = prompt_ids(tok, spec)
    drafter = StaticOnly(Drafter(static=static_cache))
    stats = DraftStats()
    out = generate(model, ids, drafter, seq_id=1, max_new_tokens=NEW_TOKENS, stats=stats)
    assert torch.equal(out, plain_outputs[spec])
    assert stats.accepted > 0 and drafter.drafter.context_rows(1).shape[0] == 0


@pytest.mark.slow
def test_remote_drafter_through_the_service(smollm2, ngc_tokenizer, plain_outputs, tmp_path):
    """The adapter takes a RemoteDrafter (one Session per sequence) as it takes a Drafter."""
    model, tok = smollm2
    spec = PROMPT_FUNCTIONS[1]
    ids = prompt_ids(tok, spec)
    fp, vocab = ngc_tokenizer.fingerprint, ngc_tokenizer.vocab_size
    with ServiceThread(tmp_path / "data") as svc:
        channel = grpc.insecure_channel(f"127.0.0.1:{svc.port}")
        admin_pb2_grpc.AdminStub(channel).CreateNamespace(
            admin_pb2.CreateNamespaceRequest(name="code", tokenizer_fingerprint=fp, vocab_size=vocab))
        channel.close()
        stats = DraftStats()
        with RemoteDrafter(f"127.0.0.1:{svc.port}", "code", (fp, vocab)) as remote:
            out = generate(model, ids, remote, seq_id=3, max_new_tokens=NEW_TOKENS, stats=stats)
    assert torch.equal(out, plain_outputs[spec])
    assert stats.accepted > 0


@pytest.mark.slow
def test_generator_reused_across_calls_counts_each_token_once(smollm2, plain_outputs):
    """A second generate() whose prompt extends the first's output continues the same drafter sequence."""
    model, tok = smollm2
    spec = PROMPT_FUNCTIONS[2]
    ids = prompt_ids(tok, spec)
    drafter = Drafter(dynamic=CountTable(), fingerprint=UNTAGGED, vocab_size=model.config.vocab_size)
    gen = NgramCandidateGenerator(drafter, seq_id=5, n_draft=6)
    first = model.generate(ids, custom_generate=ngram_decoding, ngram_candidate_generator=gen,
                           do_sample=False, max_new_tokens=NEW_TOKENS // 2)
    assert torch.equal(first, plain_outputs[spec][:, : first.shape[1]])
    second = model.generate(first, custom_generate=ngram_decoding, ngram_candidate_generator=gen,
                            do_sample=False, max_new_tokens=NEW_TOKENS - NEW_TOKENS // 2)
    assert torch.equal(second, plain_outputs[spec])
    assert gen.stats.tokens == NEW_TOKENS and gen.stats.accepted > 0
    assert_counted_once(drafter, 5, second[0])


def test_sampling_drafts_and_in_the_deterministic_limit_equals_plain_generate(smollm2):
    """do_sample=True goes through transformers' sampling verification; with top_k=1 sampling is
    argmax, so the drafted output must equal plain generate()'s token for token."""
    model, tok = smollm2
    ids = prompt_ids(tok, PROMPT_FUNCTIONS[0])
    kwargs = dict(do_sample=True, top_k=1, max_new_tokens=NEW_TOKENS)
    plain = model.generate(ids, **kwargs)
    drafter = Drafter(dynamic=CountTable(), fingerprint=UNTAGGED, vocab_size=model.config.vocab_size, mode="match")
    drafter.accept(0, plain[0].numpy().astype(np.int32))  # an earlier sequence holds the output: drafts are accepted
    stats = DraftStats()
    out = generate(model, ids, drafter, seq_id=1, stats=stats, **kwargs)
    assert torch.equal(out, plain)
    assert stats.accepted > NEW_TOKENS // 2 and stats.steps < NEW_TOKENS // 2
    torch.manual_seed(0)  # real sampling: valid tokens, drafts verified against the model's samples
    sampled = generate(model, ids, drafter, seq_id=2, do_sample=True, temperature=0.8, max_new_tokens=NEW_TOKENS)
    assert sampled.shape[1] > ids.shape[1] and int(sampled.max()) < model.config.vocab_size


@pytest.mark.slow
def test_refuses_beams_batches_and_streamers(smollm2):
    model, tok = smollm2
    ids = prompt_ids(tok, PROMPT_FUNCTIONS[0])
    drafter = Drafter(dynamic=CountTable(), fingerprint=UNTAGGED, vocab_size=model.config.vocab_size)
    with pytest.raises(ValueError, match="sampling only"):
        generate(model, ids, drafter, seq_id=1, num_beams=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="sampling only"):
        generate(model, ids, drafter, seq_id=1, do_sample=True, num_return_sequences=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="batch size 1"):
        generate(model, ids.repeat(2, 1), drafter, seq_id=1, max_new_tokens=4)
    with pytest.raises(ValueError, match="streamer"):
        generate(model, ids, drafter, seq_id=1, streamer=object(), max_new_tokens=4)
    assert "_get_candidate_generator" not in vars(model)  # the per-call override never outlives a call


def test_candidates_stay_within_max_length():
    drafter = Drafter(dynamic=CountTable(), fingerprint=UNTAGGED, vocab_size=100)
    gen = NgramCandidateGenerator(drafter, seq_id=0, n_draft=8)
    seq = torch.tensor([[1, 2, 3, 4] * 6], dtype=torch.long)
    candidates, logits = gen.get_candidates(seq)
    assert logits is None and candidates.dtype == torch.long
    assert torch.equal(candidates[0, :24], seq[0]) and candidates.shape[1] == 24 + 8
    gen.max_length = 24 + 3  # room for 2 drafted tokens and the model's own
    assert gen.get_candidates(seq)[0].shape[1] == 24 + 2
    gen.max_length = 24 + 1
    assert torch.equal(gen.get_candidates(seq)[0], seq)
    with pytest.raises(ValueError, match="one sequence"):
        gen.get_candidates(seq.repeat(2, 1))


def test_importing_the_adapters_package_loads_no_engine():
    code = ("import sys, ngramcache.client.adapters as a; "
            "assert not {'torch', 'transformers', 'llama_cpp'} & set(sys.modules), sorted(sys.modules); print(a.__name__)")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_missing_engine_names_the_extra():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "try:\n    import ngramcache.client.adapters.transformers\n"
            "except ImportError as e:\n    print(e)\nelse:\n    raise SystemExit('imported')\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert "pip install 'ngramcache[transformers]'" in out


@pytest.fixture(scope="module")
def verify_cost(smollm2):
    """The model's verify costs, measured once for both modes (about 18 s on this CPU)."""
    return measure_verify_cost(smollm2[0], repeats=3)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["compatible", "match"])
def test_cost_aware_output_equals_plain_greedy(smollm2, static_cache, plain_outputs, verify_cost, mode):
    """Cost-aware drafting only shortens drafts: greedy output unchanged; the costs measured on the model grow with k."""
    model, tok = smollm2
    spec = PROMPT_FUNCTIONS[0]
    ids = prompt_ids(tok, spec)
    cost = verify_cost
    assert cost(0) == 1.0 and cost(8) >= cost(1) >= 1.0
    drafter = Drafter(static=static_cache, dynamic=CountTable(), mode=mode)
    stats = DraftStats()
    out = generate(model, ids, drafter, seq_id=5, n_draft=8, max_new_tokens=NEW_TOKENS, stats=stats,
                   cost_aware=True, verify_cost=cost)
    assert torch.equal(out, plain_outputs[spec])
    assert stats.accepted > 0 and stats.steps + stats.accepted == stats.tokens
    # A cost no draft can pay for: no token is sent, and the output is still plain greedy decoding's.
    none = DraftStats()
    out = generate(model, ids, Drafter(static=static_cache, dynamic=CountTable(), mode=mode), seq_id=6,
                   max_new_tokens=NEW_TOKENS, stats=none, cost_aware=True, verify_cost=lambda k: 1.0 + 10.0 * k)
    assert torch.equal(out, plain_outputs[spec]) and none.drafted == 0


def test_cost_aware_needs_draft_scored(smollm2):
    model, tok = smollm2

    with pytest.raises(InvalidArgumentError, match="draft_scored"):
        generate(model, prompt_ids(tok, PROMPT_FUNCTIONS[0]), NoOddsDrafter(), seq_id=1, max_new_tokens=4, n_draft=8,
                 cost_aware=True, verify_cost=[1.0, 1.5])


@pytest.mark.slow
def test_auto_default_learns_costs_from_its_own_steps(smollm2, static_cache, plain_outputs):
    """The default, n_draft="auto": greedy output unchanged, not one forward pass besides the generation's
    (nothing measured before the first request), every step but the first timed into the model's costs."""
    model, tok = smollm2
    spec = PROMPT_FUNCTIONS[0]
    ids = prompt_ids(tok, spec)
    passes = []
    hook = model.register_forward_pre_hook(lambda module, args: passes.append(1))
    learned = learned_verify_cost(model)
    before = learned.steps
    stats = DraftStats()
    try:
        out = generate(model, ids, Drafter(static=static_cache, dynamic=CountTable(), mode="match"), seq_id=8,
                       max_new_tokens=NEW_TOKENS, stats=stats)
    finally:
        hook.remove()
    assert torch.equal(out, plain_outputs[spec])
    assert len(passes) == stats.steps and stats.steps + stats.accepted == stats.tokens
    assert learned.steps - before == stats.steps - 1 and learned is learned_verify_cost(model)
    assert stats.accepted > 0
