"""The transformers adapter's candidate generator step by step, without a model: what crosses from the engine's tensors each step."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ngramcache import UNTAGGED, Drafter  # noqa: E402
from ngramcache.client.adapters import transformers as adapter  # noqa: E402
from ngramcache.client.adapters.step_costs import StepCosts  # noqa: E402


def test_each_step_copies_only_the_kept_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop hands get_candidates the tensor update_candidate_strategy was given, which is the verified
    sequence plus the kept tokens: on a GPU, copying the whole sequence to the host twice a step is two
    syncs and O(length) bytes; the generator copies the prompt once and then only each step's new tokens."""
    copied: list[int] = []
    real = adapter._to_numpy

    def counting(ids):
        copied.append(int(ids.shape[1]))
        return real(ids)

    monkeypatch.setattr(adapter, "_to_numpy", counting)
    gen = adapter.NgramCandidateGenerator(Drafter(vocab_size=500, fingerprint=UNTAGGED, mode="match"), 1)
    prompt = list(range(100, 200)) * 3
    ids = torch.tensor([prompt], dtype=torch.long)
    for step in range(20):
        cand, logits = gen.get_candidates(ids)
        assert logits is None and torch.equal(cand[:, : ids.shape[1]], ids)
        kept = (cand.shape[1] - ids.shape[1]) // 2
        ids = torch.cat((cand[:, : ids.shape[1] + kept], torch.tensor([[7 + step]])), dim=1)  # the model's own token
        gen.update_candidate_strategy(ids, torch.empty(0), kept)
    assert gen.feed.seen is not None and gen.feed.seen.tolist() == ids[0].tolist()
    assert sum(copied) == ids.shape[1]  # every token crossed once
    assert isinstance(gen.feed.policy.cost, StepCosts) and gen.feed.n_draft == 64  # the default: "auto"
    assert gen.feed._uncapped  # a match-mode Drafter drafts uncapped: the policy cuts


def test_a_tensor_not_handed_back_is_read_whole() -> None:
    """Another sequence than the one accepted last (a rewind, a new call) is copied and compared whole."""
    gen = adapter.NgramCandidateGenerator(Drafter(vocab_size=500, fingerprint=UNTAGGED, mode="match"), 1, n_draft=4)
    ids = torch.tensor([list(range(100, 140)) * 2], dtype=torch.long)
    gen.get_candidates(ids)
    gen.update_candidate_strategy(torch.cat((ids, torch.tensor([[100]])), dim=1), torch.empty(0), 0)
    other = torch.tensor([[5, 6, 5, 6, 5, 6]], dtype=torch.long)
    cand, _ = gen.get_candidates(other)
    assert gen.feed.seen is not None and gen.feed.seen.tolist() == [5, 6, 5, 6, 5, 6]
    assert cand.shape[1] - other.shape[1] <= 4
