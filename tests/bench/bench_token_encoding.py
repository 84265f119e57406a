"""Benchmark of the two wire forms of token arrays and count rows in protobuf (prints figures; not a test).

    python tests/bench/bench_token_encoding.py [--reps 7] [--target-ms 20] [--verbose]
    python tests/bench/bench_token_encoding.py --quick     # checks the script (a second; figures meaningless)

For each payload it builds a message from a numpy int32 array, serializes it, parses it
and converts the field back to numpy, both ways, with the installed protobuf runtime (the
upb backend in this venv):

* ``packed``: a ``repeated int32`` field (packed varints), filled from ``arr.tolist()``
  (by ``extend`` or the constructor) and read back with ``np.array(field)`` or
  ``np.fromiter(field)``; the figure is the fastest encoder plus the fastest decoder;
* ``bytes``: a ``bytes`` field holding the int32 values little-endian, filled with
  ``arr.astype('<i4').tobytes()`` and read back with ``np.frombuffer(field, '<i4')``
  (no copy).

Payloads: token arrays of 8, 64, 1k and 32k tokens (Zipf-distributed ids below a 152k
vocabulary, as Qwen's) and int32 delta rows (m, 7) of 1k and 64k rows (unused token
slots -1, as client.rows has them). Each figure is the median over ``--reps`` runs of the
mean time of a loop lasting about ``--target-ms``, after a warm-up call. The messages are
declared here from a descriptor, so the benchmark does not depend on the generated code.
Every decoder's output is compared with the input, and a checksum of the decoded data is
printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.internal import api_implementation

VOCAB = 151_643  # Qwen2's vocabulary: ids above 2^14 take 3 varint bytes
SEED = 20_240_801


def message_classes() -> tuple[Any, Any]:
    """Two one-field messages: Packed { repeated int32 v = 1; } and Raw { bytes v = 1; }."""
    fdp = descriptor_pb2.FileDescriptorProto(name="bench_token_encoding.proto", package="bench", syntax="proto3")
    packed = fdp.message_type.add(name="Packed")
    packed.field.add(name="v", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT32,
                     label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED)
    raw = fdp.message_type.add(name="Raw")
    raw.field.add(name="v", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
                  label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return (message_factory.GetMessageClass(pool.FindMessageTypeByName("bench.Packed")),
            message_factory.GetMessageClass(pool.FindMessageTypeByName("bench.Raw")))


Packed, Raw = message_classes()

# The ways tried for each direction; a form's figure is its fastest encoder plus its fastest decoder.
Encoder = Callable[[np.ndarray], bytes]
Decoder = Callable[[bytes], np.ndarray]


def _packed_encode_extend(arr: np.ndarray) -> bytes:
    msg = Packed()
    msg.v.extend(arr.ravel().tolist())
    return msg.SerializeToString()


def _packed_encode_ctor(arr: np.ndarray) -> bytes:
    return Packed(v=arr.ravel().tolist()).SerializeToString()


def _packed_decode_array(data: bytes) -> np.ndarray:
    return np.array(Packed.FromString(data).v, dtype=np.int32)


def _packed_decode_fromiter(data: bytes) -> np.ndarray:
    field = Packed.FromString(data).v
    return np.fromiter(field, dtype=np.int32, count=len(field))


def _raw_encode(arr: np.ndarray) -> bytes:
    return Raw(v=arr.astype("<i4", copy=False).tobytes()).SerializeToString()


def _raw_decode(data: bytes) -> np.ndarray:
    return np.frombuffer(Raw.FromString(data).v, dtype="<i4")


FORMS: dict[str, tuple[dict[str, Encoder], dict[str, Decoder]]] = {
    "packed": ({"extend(arr.tolist())": _packed_encode_extend, "Packed(v=arr.tolist())": _packed_encode_ctor},
               {"np.array(field)": _packed_decode_array, "np.fromiter(field)": _packed_decode_fromiter}),
    "bytes": ({"arr.astype('<i4').tobytes()": _raw_encode}, {"np.frombuffer(field, '<i4')": _raw_decode}),
}


def timed(fn: Callable[[], object], target_s: float, reps: int) -> float:
    """Median over ``reps`` runs of the mean seconds per call of a loop lasting about ``target_s``."""
    start = time.perf_counter()
    fn()  # warm-up, and a first estimate of the cost
    once = max(time.perf_counter() - start, 1e-7)
    loops = max(1, int(target_s / once))
    runs = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        runs.append((time.perf_counter() - start) / loops)
    return statistics.median(runs)


def make_tokens(rng: np.random.Generator, k: int) -> np.ndarray:
    """k token ids: Zipf-distributed below VOCAB (mostly frequent ids, a long tail of large ones)."""
    return ((rng.zipf(1.1, k) - 1) % VOCAB).astype(np.int32)


def make_rows(rng: np.random.Generator, m: int) -> np.ndarray:
    """m delta rows (n, t0, t1, t2, t3, follower, count): n in 1..4, unused slots -1, count 1..3."""
    n = rng.integers(1, 5, m)
    toks = make_tokens(rng, m * 5).reshape(m, 5)
    rows = np.empty((m, 7), dtype=np.int32)
    rows[:, 0] = n
    rows[:, 1:5] = np.where(np.arange(4)[None, :] < n[:, None], toks[:, :4], -1)
    rows[:, 5] = toks[:, 4]
    rows[:, 6] = rng.integers(1, 4, m)
    return rows


def measure(label: str, arr: np.ndarray, target_s: float, reps: int, verbose: bool) -> dict[str, dict[str, float]]:
    """Per form: the best encode and decode seconds, their sum, the wire size and a checksum of the decoded data."""
    out: dict[str, dict[str, float]] = {}
    for form, (encoders, decoders) in FORMS.items():
        wire = next(iter(encoders.values()))(arr)
        checksum = None
        for encode in encoders.values():
            if encode(arr) != wire:
                raise AssertionError(f"{form}: the encoders disagree")
        for decode in decoders.values():
            back = decode(wire)
            if not np.array_equal(back, arr.ravel()):
                raise AssertionError(f"{form} does not round-trip")
            checksum = int(back.astype(np.int64).sum())
        enc = {name: timed(lambda encode=encode, arr=arr: encode(arr), target_s, reps) for name, encode in encoders.items()}
        dec = {name: timed(lambda decode=decode, wire=wire: decode(wire), target_s, reps) for name, decode in decoders.items()}
        if verbose:
            for name, t in (*enc.items(), *dec.items()):
                print(f"{label:<16} {form:<8} {name:<30} {t * 1e6:>10.2f} us")
        out[form] = {"encode": min(enc.values()), "decode": min(dec.values()), "wire": len(wire),
                     "checksum": float(checksum if checksum is not None else 0)}
        out[form]["total"] = out[form]["encode"] + out[form]["decode"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7, help="runs per figure (the median is printed)")
    parser.add_argument("--target-ms", type=float, default=20.0, help="duration of one run")
    parser.add_argument("--verbose", action="store_true", help="also print every encoder and decoder tried")
    parser.add_argument("--quick", action="store_true", help="checks the script: 1 run of 2 ms per figure (figures meaningless)")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.target_ms = 1, 2.0

    import google.protobuf
    print(f"protobuf {google.protobuf.__version__} ({api_implementation.Type()} backend), numpy {np.__version__}, "
          f"Python {sys.version.split()[0]}; medians of {args.reps} runs")
    rng = np.random.default_rng(SEED)
    cases = [(f"{k} tokens", make_tokens(rng, k)) for k in (8, 64, 1024, 32768)]
    cases += [(f"{m} rows (x7)", make_rows(rng, m)) for m in (1024, 65536)]

    head = f"{'payload':<16} {'form':<8} {'encode us':>10} {'decode us':>10} {'total us':>10} {'wire B':>9}"
    print(head)
    print("-" * len(head))
    checksum = 0
    ratios = []
    for label, arr in cases:
        res = measure(label, arr, args.target_ms / 1000.0, args.reps, args.verbose)
        for name in FORMS:
            r = res[name]
            print(f"{label:<16} {name:<8} {r['encode'] * 1e6:>10.2f} {r['decode'] * 1e6:>10.2f} "
                  f"{r['total'] * 1e6:>10.2f} {int(r['wire']):>9}")
        if len({int(r["checksum"]) for r in res.values()}) != 1:
            raise AssertionError(f"{label}: the forms decoded different data")
        checksum += int(res["bytes"]["checksum"])
        ratio = res["packed"]["total"] / res["bytes"]["total"]
        ratios.append((label, ratio, res["packed"]["wire"] / res["bytes"]["wire"]))
    print()
    print(f"{'payload':<16} {'packed / bytes time':>20} {'packed / bytes wire':>20}")
    for label, ratio, wire_ratio in ratios:
        print(f"{label:<16} {ratio:>19.1f}x {wire_ratio:>19.2f}x")
    print(f"\nresult checksum {checksum}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
