"""The vLLM proposer backed by a real service (loopback gRPC): through an `NgramClient` and a `RemoteDrafter`, as NGC_VLLM_SERVICE configures it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from helpers.service import ServiceThread
from helpers.tls import Pki

from ngramcache import CountTable, Drafter, StaticCache, build_static_from_tokens
from ngramcache.client.adapters.vllm import NgramCacheProposer, ProposerConfig
from ngramcache.client.kernel.tokenizer import load_tokenizer
from ngramcache.client.sync.admin import AdminClient

pytestmark = pytest.mark.integration

TOKENIZER = "tiktoken:qwen"
TEXT = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n"


@pytest.mark.parametrize("remote", ["0", "1"])
def test_drafts_come_from_the_namespace_generation(tmp_path, remote):
    tok = load_tokenizer(TOKENIZER)
    corpus = tok.encode(TEXT * 3)
    path = tmp_path / "g.ngc"
    build_static_from_tokens([corpus], path, vocab_size=tok.vocab_size, fingerprint=tok.fingerprint, generation=1)
    with ServiceThread(tmp_path / "data") as svc:
        address = f"127.0.0.1:{svc.port}"
        with AdminClient(address) as admin:
            admin.create_namespace("code", tok)
            admin.publish("code", path)
        env = {"NGC_VLLM_SERVICE": address, "NGC_VLLM_NAMESPACE": "code", "NGC_VLLM_TOKENIZER": TOKENIZER,
               "NGC_VLLM_REMOTE": remote, "NGC_VLLM_CACHE_DIR": str(tmp_path / "cache")}
        config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=6),
                                 model_config=SimpleNamespace(max_model_len=512, tokenizer=None),
                                 scheduler_config=SimpleNamespace(max_num_seqs=4))
        proposer = NgramCacheProposer(config, ProposerConfig.from_env(env))
        try:
            token_ids = np.zeros((4, 512), dtype=np.int32)
            num_tokens = np.zeros(4, dtype=np.int32)
            prompt = corpus[:20]  # inside the corpus: the generation has followers for it
            token_ids[0, :20] = prompt
            num_tokens[0] = 20
            drafts = proposer.propose([[int(prompt[-1])]], num_tokens, token_ids, slot_mappings=None)
            local = Drafter(StaticCache.open(path), dynamic=CountTable())
            local.accept(1, prompt)
            want = local.draft(1, prompt, 6).tolist()
            assert want and drafts == [want]
        finally:
            proposer.close()


@pytest.mark.parametrize("remote", ["0", "1"])
@pytest.mark.parametrize("mutual", [False, True])
def test_a_tls_service_is_reached_through_the_environment(tmp_path, remote, mutual):
    """NGC_VLLM_TLS_CA (and, for mutual TLS, NGC_VLLM_TLS_CERT/KEY) reach a TLS service: no subclass needed."""
    pki = Pki(tmp_path / "pki")
    server, client = pki.issue("server"), pki.issue("client", client=True)
    tok = load_tokenizer(TOKENIZER)
    corpus = tok.encode(TEXT * 3)
    path = tmp_path / "g.ngc"
    build_static_from_tokens([corpus], path, vocab_size=tok.vocab_size, fingerprint=tok.fingerprint, generation=1)
    mutual_tls = {"tls_client_ca": str(pki.ca.cert)} if mutual else {}
    mine = {"tls_cert": str(client.cert), "tls_key": str(client.key)} if mutual else {}
    with ServiceThread(tmp_path / "data", tls_cert=str(server.cert), tls_key=str(server.key), **mutual_tls) as svc:
        address = f"127.0.0.1:{svc.port}"
        with AdminClient(address, tls_ca=str(pki.ca.cert), **mine) as admin:
            admin.create_namespace("code", tok)
            admin.publish("code", path)
        env = {"NGC_VLLM_SERVICE": address, "NGC_VLLM_NAMESPACE": "code", "NGC_VLLM_TOKENIZER": TOKENIZER,
               "NGC_VLLM_REMOTE": remote, "NGC_VLLM_CACHE_DIR": str(tmp_path / "cache"),
               "NGC_VLLM_TLS_CA": str(pki.ca.cert)}
        if mutual:
            env |= {"NGC_VLLM_TLS_CERT": str(client.cert), "NGC_VLLM_TLS_KEY": str(client.key)}
        config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=6),
                                 model_config=SimpleNamespace(max_model_len=512, tokenizer=None),
                                 scheduler_config=SimpleNamespace(max_num_seqs=4))
        proposer = NgramCacheProposer(config, ProposerConfig.from_env(env))
        try:
            token_ids = np.zeros((4, 512), dtype=np.int32)
            num_tokens = np.zeros(4, dtype=np.int32)
            prompt = corpus[:20]
            token_ids[0, :20] = prompt
            num_tokens[0] = 20
            drafts = proposer.propose([[int(prompt[-1])]], num_tokens, token_ids, slot_mappings=None)
            local = Drafter(StaticCache.open(path), dynamic=CountTable())
            local.accept(1, prompt)
            want = local.draft(1, prompt, 6).tolist()
            assert want and drafts == [want]
        finally:
            proposer.close()
