"""Records the fleet-history benchmark's workloads once from SmolLM2-135M-Instruct on CPU.

Three workloads, every prompt written by this script from templates (names and numbers drawn
from a seeded generator) and wrapped in the model's chat template:

- ``rollout`` (a): RL-style rollout groups. Word problems solved step by step, small Python
  tasks and "convert to JSON" requests; `--samples` samples per prompt (default 8, drawn
  with ``num_return_sequences``; `--batch-rows` rows per generate call, prompts left-padded) at temperature 0.8, top-p 0.95.
- ``repeated`` (b): one task applied to many inputs (unittest test cases for small functions):
  the answers share a structure (imports, class and method layout, assert calls) that is not
  in their prompts. One sample each at temperature 0.7.
- ``control`` (c): unrelated requests on varied topics, one sample each, same sampling.

Every sample is stored with its workload, its group (the prompt's index), the prompt's tokens
and the output's tokens (up to and including the end-of-turn token when the model emitted one,
padding cut). The file is a compressed .npz (a few hundred KB):

- ``prompt_tokens`` int32 (all prompts concatenated), ``prompt_offsets`` int64 (n_prompts + 1),
  ``prompt_workload`` int8 (0 rollout, 1 repeated, 2 control);
- ``output_tokens`` int32, ``output_offsets`` int64 (n_samples + 1), ``sample_prompt`` int32
  (the prompt each sample answers: its group id), ``sample_workload`` int8;
- ``meta``: a JSON string (model file, seed, sampling settings, timings, vocabulary size).

The seed fixes the prompts and each generate call's sampling (torch's generator is reseeded
per generate call), so a rerun on the same software gives the same file. Heavy (25 minutes on this
shared 2-core VM for the defaults: 76k sampled tokens at about 55 tokens/s); run it as

    flock /tmp/ngc-heavy.lock nice python tests/bench/record_workloads.py
    python tests/bench/record_workloads.py --rollout 2 --repeated 2 --control 2 --out /tmp/w.npz  # sizing run
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

DEFAULT_OUT = ROOT / "tests" / "bench" / "data" / "fleet_workloads.npz"
WORKLOADS = ("rollout", "repeated", "control")

NAMES = ("Alice", "Bruno", "Chen", "Dara", "Elif", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kofi", "Lena",
         "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera", "Wen", "Yusuf")
CITIES = ("Paris", "Lagos", "Osaka", "Lima", "Oslo", "Cairo", "Denver", "Hanoi", "Porto", "Quito", "Riga", "Sydney")
ITEMS = (("apples", "bag"), ("pencils", "box"), ("cookies", "tray"), ("marbles", "jar"), ("stickers", "sheet"),
         ("eggs", "carton"), ("books", "shelf"), ("cards", "pack"))


def _word_problem(rng: random.Random) -> str:
    name = rng.choice(NAMES)
    item, unit = rng.choice(ITEMS)
    have, units, per, given = rng.randint(3, 40), rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 15)
    return (f"{name} has {have} {item}. {name} buys {units} {unit}s with {per} {item} in each {unit}, then gives "
            f"{given} {item} to a friend. How many {item} does {name} have now? Solve it step by step, "
            "showing each calculation, and end with 'Answer: <number>'.")


CODING_TASKS = (
    ("count_vowels", "counts the vowels in a string"),
    ("is_palindrome", "checks whether a string reads the same backwards, ignoring case"),
    ("running_total", "returns the running totals of a list of numbers"),
    ("flatten", "flattens a list of lists into one list"),
    ("word_lengths", "maps each word of a sentence to its length in a dictionary"),
    ("second_largest", "returns the second largest number of a list"),
    ("celsius_to_fahrenheit", "converts a list of Celsius temperatures to Fahrenheit"),
    ("remove_duplicates", "removes duplicates from a list while keeping the order"),
    ("chunk", "splits a list into chunks of size n"),
    ("capitalize_words", "capitalizes the first letter of every word in a string"),
    ("sum_of_digits", "returns the sum of the digits of an integer"),
    ("merge_dicts", "merges two dictionaries, adding the values of common keys"),
)


def _coding_task(rng: random.Random) -> str:
    name, what = rng.choice(CODING_TASKS)
    suffix = rng.choice(("", "_v2", "_fast", "_simple"))
    return f"Write a Python function `{name}{suffix}` that {what}. Include a short docstring and one example call."


def _json_task(rng: random.Random) -> str:
    name, city = rng.choice(NAMES), rng.choice(CITIES)
    age, orders, score = rng.randint(18, 80), rng.randint(0, 50), round(rng.uniform(1, 5), 1)
    return (f"Convert this record to JSON with keys name, age, city, orders and rating: {name} is {age} years old, "
            f"lives in {city}, has placed {orders} orders and rates the shop {score} out of 5.")


def rollout_prompt(rng: random.Random, index: int) -> str:
    """The index-th rollout prompt: the three kinds in turn."""
    return (_word_problem, _coding_task, _json_task)[index % 3](rng)


OPS = (("+", "adds"), ("-", "subtracts"), ("*", "multiplies"), ("//", "floor-divides"), ("%", "takes the remainder of"),
       ("**", "raises"), ("max", "takes the larger of"), ("min", "takes the smaller of"))
VERBS = ("combine", "merge", "blend", "mix", "join", "fold", "pair", "apply")
NOUNS = ("prices", "scores", "points", "weights", "totals", "counts", "values", "levels")


def repeated_prompt(rng: random.Random, index: int) -> str:
    """A unittest request for a small two-argument function (the same task every time)."""
    op, _ = OPS[index % len(OPS)]
    fn = f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}"
    a, b = rng.choice("xyabmn"), rng.choice("uvkpqr")
    body = f"return {op}({a}, {b})" if op in ("max", "min") else f"return {a} {op} {b}"
    return ("Write a unittest TestCase class with three test methods for this Python function:\n\n"
            f"def {fn}({a}, {b}):\n    {body}\n")


CONTROL_TEMPLATES = (
    "Write a haiku about {thing}.",
    "Explain in two sentences how a {device} works.",
    "Give three tips for someone learning to {skill}.",
    "What is the history of {city} in a few sentences?",
    "Describe the taste of {food} to someone who never had it.",
    "Suggest a name for a {pet} and say why.",
    "Write a short thank-you note to {name} for a {gift}.",
    "Why is the sky blue? Answer for a {age}-year-old.",
    "List four facts about {animal}.",
    "Summarize the plot of a story about {name} who finds a {thing}.",
    "What should I pack for a {days}-day trip to {city}?",
    "Translate 'good morning, {name}' into French and Spanish.",
    "How do I fix a squeaky {device}?",
    "Compare {food} and {food2} in one paragraph.",
    "Write a limerick about a {animal} from {city}.",
    "What are the rules of {game}?",
)
FILL = {
    "thing": ("autumn rain", "a lighthouse", "an old key", "the moon", "a red kite", "snow"),
    "device": ("bicycle", "refrigerator", "door hinge", "microwave", "thermostat", "compass"),
    "skill": ("swim", "paint", "play chess", "bake bread", "code", "juggle"),
    "food": ("mango", "miso soup", "olives", "dark chocolate", "kimchi", "figs"),
    "food2": ("rice", "pasta", "quinoa", "bread", "potatoes", "couscous"),
    "pet": ("cat", "parrot", "hamster", "goldfish", "puppy", "turtle"),
    "gift": ("scarf", "book", "plant", "mug", "concert ticket", "cake"),
    "animal": ("octopuses", "owls", "elephants", "bees", "penguins", "foxes"),
    "game": ("chess", "checkers", "go", "tic-tac-toe", "dominoes", "rummy"),
}


def control_prompt(rng: random.Random, index: int) -> str:
    """An unrelated request: template index % 16 with random fillers."""
    template = CONTROL_TEMPLATES[index % len(CONTROL_TEMPLATES)]
    values = {key: rng.choice(options) for key, options in FILL.items()}
    values.update(name=rng.choice(NAMES), city=rng.choice(CITIES), age=rng.randint(5, 12), days=rng.randint(2, 10))
    return template.format(**values)


def build_prompts(counts: dict[str, int], seed: int) -> list[tuple[str, str]]:
    """(workload, user message) for every prompt, in recording order."""
    makers = {"rollout": rollout_prompt, "repeated": repeated_prompt, "control": control_prompt}
    out: list[tuple[str, str]] = []
    for w_index, workload in enumerate(WORKLOADS):
        rng = random.Random(seed * 1000 + w_index)
        out.extend((workload, makers[workload](rng, i)) for i in range(counts[workload]))
    return out


def _cut_output(row: Any, eos_id: int) -> np.ndarray:
    """A generated row up to and including the first end-of-turn token (padding after it dropped)."""
    toks = np.asarray(row, dtype=np.int32)
    hits = np.flatnonzero(toks == eos_id)
    return toks[: hits[0] + 1] if hits.size else toks


def _batches(prompts: list[tuple[str, str]], samples: int, batch_rows: int) -> list[list[int]]:
    """Prompt indices per generate call: consecutive prompts of one workload, at most `batch_rows`
    rows (a rollout prompt is `samples` rows)."""
    out: list[list[int]] = []
    for index, (workload, _) in enumerate(prompts):
        per_batch = max(1, batch_rows // samples) if workload == "rollout" else batch_rows
        if out and prompts[out[-1][0]][0] == workload and len(out[-1]) < per_batch:
            out[-1].append(index)
        else:
            out.append([index])
    return out


def record(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from helpers.model import load_transformers_model, smollm2_gguf

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tokenizer = load_transformers_model()
    print(f"model loaded in {time.perf_counter() - t0:.1f} s ({smollm2_gguf().name}, {args.threads} threads)", flush=True)
    eos_id = int(tokenizer.eos_token_id)
    counts = {"rollout": args.rollout, "repeated": args.repeated, "control": args.control}
    prompts = build_prompts(counts, args.seed)

    prompt_arrays: list[np.ndarray] = []
    outputs: list[np.ndarray] = []
    sample_prompt: list[int] = []
    sample_workload: list[int] = []
    seconds = dict.fromkeys(WORKLOADS, 0.0)
    for message in (m for _, m in prompts):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
        prompt_arrays.append(np.asarray(ids if isinstance(ids, list) else ids["input_ids"], dtype=np.int32))
    t_all = time.perf_counter()
    for batch_index, batch in enumerate(_batches(prompts, args.samples, args.batch_rows)):
        workload = prompts[batch[0]][0]
        n_samples = args.samples if workload == "rollout" else 1
        temperature = 0.8 if workload == "rollout" else 0.7
        width = max(len(prompt_arrays[p]) for p in batch)
        # Left padding (with a zero attention mask) so every row's new tokens start at column `width`.
        input_ids = torch.full((len(batch), width), eos_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):
            n = len(prompt_arrays[p])
            input_ids[row, width - n:] = torch.from_numpy(prompt_arrays[p].astype(np.int64))
            mask[row, width - n:] = 1
        torch.manual_seed(args.seed * 100003 + batch_index)
        t_gen = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=mask, do_sample=True, temperature=temperature, top_p=0.95,
                                 top_k=0, max_new_tokens=args.max_new_tokens, num_return_sequences=n_samples,
                                 pad_token_id=eos_id, eos_token_id=eos_id)
        seconds[workload] += time.perf_counter() - t_gen
        w_code = WORKLOADS.index(workload)
        lengths = []
        # generate() repeats each input row num_return_sequences times, consecutively.
        for row, generated in enumerate(out[:, width:].tolist()):
            outputs.append(_cut_output(generated, eos_id))
            sample_prompt.append(batch[row // n_samples])
            sample_workload.append(w_code)
            lengths.append(len(outputs[-1]))
        print(f"[{batch[-1] + 1}/{len(prompts)}] {workload}: {len(batch)} prompts x {n_samples}, "
              f"{sum(lengths)} tokens (mean {np.mean(lengths):.0f}) in {time.perf_counter() - t_gen:.1f} s "
              f"(total {time.perf_counter() - t_all:.0f} s)", flush=True)
    prompt_workload = [WORKLOADS.index(w) for w, _ in prompts]

    def concat(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(a) for a in arrays])
        tokens = np.concatenate(arrays).astype(np.int32) if arrays else np.zeros(0, dtype=np.int32)
        return tokens, offsets

    prompt_tokens, prompt_offsets = concat(prompt_arrays)
    output_tokens, output_offsets = concat(outputs)
    meta = {
        "model": smollm2_gguf().name, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
        "samples_per_rollout_prompt": args.samples, "temperature": {"rollout": 0.8, "repeated": 0.7, "control": 0.7},
        "top_p": 0.95, "eos_token_id": eos_id, "vocab_size": len(tokenizer), "threads": args.threads, "batch_rows": args.batch_rows,
        "workloads": list(WORKLOADS), "prompts": counts, "generate_seconds": {k: round(v, 1) for k, v in seconds.items()},
        "torch": torch.__version__,
    }
    return {
        "prompt_tokens": prompt_tokens, "prompt_offsets": prompt_offsets,
        "prompt_workload": np.asarray(prompt_workload, dtype=np.int8),
        "output_tokens": output_tokens, "output_offsets": output_offsets,
        "sample_prompt": np.asarray(sample_prompt, dtype=np.int32),
        "sample_workload": np.asarray(sample_workload, dtype=np.int8),
        "meta": np.asarray(json.dumps(meta, sort_keys=True)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Records the fleet-history workloads (rollout groups, a repeated task, "
                                             "a negative control) from SmolLM2-135M-Instruct on CPU.")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output .npz (default {DEFAULT_OUT.relative_to(ROOT)})")
    ap.add_argument("--seed", type=int, default=20, help="fixes the prompts and the sampling (default 20)")
    ap.add_argument("--rollout", type=int, default=64, help="rollout prompts (workload a; default 64)")
    ap.add_argument("--samples", type=int, default=8, help="samples per rollout prompt (default 8)")
    ap.add_argument("--repeated", type=int, default=64, help="requests of the repeated task (workload b; default 64)")
    ap.add_argument("--control", type=int, default=64, help="unrelated requests (workload c; default 64)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-rows", type=int, default=32,
                    help="rows per generate call (a rollout prompt takes --samples rows; default 32: 4 rollout "
                         "prompts or 32 single requests, twice the tokens/s of one prompt's 8 rows)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--print-prompts", action="store_true", help="print the prompts and exit (no model)")
    args = ap.parse_args(argv)
    if min(args.rollout, args.repeated, args.control) < 0 or args.samples < 1 or args.max_new_tokens < 1 or args.batch_rows < 1:
        ap.error("counts must be >= 0, --samples, --max-new-tokens and --batch-rows >= 1")

    if args.print_prompts:
        counts = {"rollout": args.rollout, "repeated": args.repeated, "control": args.control}
        for workload, message in build_prompts(counts, args.seed):
            print(f"--- {workload}\n{message}")
        return 0
    try:
        arrays = record(args)
    except FileNotFoundError as e:  # the model wheel is missing: say how to install it
        print(f"error: {e}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **arrays)  # type: ignore[arg-type]
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1024:.0f} KB): {len(arrays['prompt_offsets']) - 1} prompts, "
          f"{len(arrays['output_offsets']) - 1} samples, {len(arrays['output_tokens'])} output tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
