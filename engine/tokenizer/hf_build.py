"""Build the `tokenizers` (Hugging Face) model behind a GGUF vocabulary.

Two shapes, as llama.cpp reads them:
- `gpt2`: byte-level BPE with the file's merges; the pre-tokenizer is a chain of regex splits picked by
  `tokenizer.ggml.pre` (llama.cpp's per-model table), then the byte -> unicode mapping.
- `llama`: SentencePiece BPE. The file carries scores but no merges; llama.cpp merges the adjacent pair whose
  concatenation is a token with the highest score. The same result comes from BPE whose merges are every
  split (a, b) of every token t with a, b in the vocabulary, ranked by t's score.

Special-token splitting is not done here: the Tokenizer partitions text on them first, as llama.cpp does.
"""

from __future__ import annotations

import warnings

import numpy as np
from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

# GGUF token types (llama.cpp's LLAMA_TOKEN_TYPE_*).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The regexes llama.cpp applies one after another (each splits the pieces the previous one left).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTION
          + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTION
          + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (regex chain, ignore_merges). Names follow llama.cpp's llama-vocab.cpp.
_PRE: dict[str, tuple[tuple[str, ...], bool]] = {}
for _names, _spec in [
    (("gpt2", "gpt-2", "phi-2", "roberta-bpe", "mpt", "olmo", "jais"), ((_GPT2,), False)),
    (("default",), ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"), False)),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
     ((r"\p{N}", _GPT2), False)),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "lfm2"), ((_LLAMA3,), True)),
    (("dbrx", "smaug-bpe"), ((_LLAMA3,), False)),
    (("qwen2", "stablelm2", "megrez"), ((_QWEN2,), False)),
    (("qwen35",), ((_QWEN35,), False)),
    (("gpt-4o",), ((_GPT4O,), False)),
    (("falcon",), ((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"), False)),
]:
    for _n in _names:
        _PRE[_n] = _spec

# Pre-tokenizers after which llama.cpp adds BOS by default (the file's add_bos_token still wins).
PRE_ADDS_BOS = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3"})


def build_gpt2(vocab: dict[str, int], merges: list[str], pre: str) -> HFTokenizer:
    """Byte-level BPE over the file's vocabulary and merges ("a b" strings)."""
    if pre not in _PRE:
        warnings.warn(f"unknown tokenizer.ggml.pre {pre!r}: splitting text as GPT-2 does; "
                      "token ids may differ from llama.cpp's", stacklevel=3)
        pre = "gpt2"
    regexes, ignore_merges = _PRE[pre]
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if sep and a in vocab and b in vocab and a + b in vocab:
            pairs.append((a, b))
    tok = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tok


def build_gemma4(vocab: dict[str, int], merges: list[str], unk: str | None) -> HFTokenizer:
    """Gemma 4's vocabulary (GGUF `gemma4`): BPE over text whose spaces are U+2581 (the caller writes them),
    ranked merges, byte fallback for characters outside the vocabulary; the text is split only at newlines
    before the merges, as llama.cpp does."""
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if sep and a in vocab and b in vocab:
            pairs.append((a, b))
    tok = HFTokenizer(models.BPE(vocab, pairs, byte_fallback=True, unk_token=unk if unk in vocab else None,
                                 fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated")
    return tok


def build_spm(tokens: list[str], vocab: dict[str, int], scores: np.ndarray, attrs: np.ndarray,
              unk: str | None) -> HFTokenizer:
    """SentencePiece-style BPE: merges derived from the scores, byte fallback for characters not in the vocab."""
    left, right = spm_merge_pairs(tokens, scores, attrs)
    take = tokens.__getitem__
    pairs = list(zip(map(take, left.tolist()), map(take, right.tolist())))
    model = models.BPE(vocab, pairs, byte_fallback=True, unk_token=unk if unk in vocab else None)
    return HFTokenizer(model)


def spm_merge_pairs(tokens: list[str], scores: np.ndarray, attrs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (left id, right id) whose concatenation is a token, best score of the result first.

    Vectorised with a polynomial hash of every prefix/suffix (262k tokens: ~1.2M split points), since a
    Python loop over the splits takes seconds (docs/benchmarks.md, "Measurements behind the code", spm merge
    pairs). Only results that can occur in text after special-token partitioning are kept: normal and byte
    tokens (control/user-defined text never reaches this model).
    """
    n = len(tokens)
    lens = np.fromiter(map(len, tokens), dtype=np.int64, count=n)  # (n,)
    cps = np.frombuffer("".join(tokens).encode("utf-32-le"), dtype=np.uint32).astype(np.uint64) + 1  # (C,)
    ends = np.cumsum(lens)  # exclusive end of each token in the flat code point array
    starts = ends - lens
    base = np.uint64(0x100000001B3)  # odd, so invertible modulo 2**64
    inv = np.uint64(pow(int(base), -1, 1 << 64))
    c = len(cps)
    with np.errstate(over="ignore"):
        pw = np.cumprod(np.full(c + 1, base, dtype=np.uint64))  # pw[i] = base**(i+1)
        pw = np.concatenate(([np.uint64(1)], pw[:-1]))  # base**i
        ipw = np.cumprod(np.full(c + 1, inv, dtype=np.uint64))
        ipw = np.concatenate(([np.uint64(1)], ipw[:-1]))  # base**-i
        acc = np.concatenate(([np.uint64(0)], np.cumsum(cps * ipw[:c])))  # acc[k] = sum_{i<k} c_i base**-i

        def span(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:  # hash of cps[lo:hi] = sum c_i base**(hi-1-i)
            return (acc[hi] - acc[lo]) * pw[hi - 1]

        full = np.zeros(n, dtype=np.uint64)
        nz = lens > 0
        full[nz] = span(starts[nz], ends[nz])
        # split points: token t split after k chars, 1 <= k < len(t)
        tid = np.repeat(np.arange(n), np.maximum(lens - 1, 0))  # (S,)
        k = np.arange(len(tid)) - np.repeat(np.cumsum(np.maximum(lens - 1, 0)) - np.maximum(lens - 1, 0),
                                            np.maximum(lens - 1, 0)) + 1
        keep = (attrs[tid] == NORMAL) | (attrs[tid] == BYTE)
        tid, k = tid[keep], k[keep]
        mid = starts[tid] + k
        pre_h = span(starts[tid], mid)
        suf_h = span(mid, ends[tid])

    order = np.argsort(full, kind="stable")
    sorted_h = full[order]

    def find(h: np.ndarray) -> np.ndarray:  # token id per hash, -1 where none; sorted queries search faster
        qo = np.argsort(h)
        i = np.minimum(np.searchsorted(sorted_h, h[qo]), n - 1)
        hit = np.empty(len(h), dtype=np.int64)
        hit[qo] = np.where(sorted_h[i] == h[qo], order[i], -1)
        return hit

    a = find(pre_h)
    sel = np.flatnonzero(a >= 0)  # look suffixes up only where the prefix is a token
    a, tid, k, suf_h = a[sel], tid[sel], k[sel], suf_h[sel]
    b = find(suf_h)
    # lengths must add up too: guards against a 64-bit hash collision
    ok = (b >= 0) & (lens[a] == k) & (lens[np.maximum(b, 0)] == lens[tid] - k)
    a, b, tid = a[ok], b[ok], tid[ok]
    rank = np.lexsort((tid, -scores.astype(np.float64)[tid]))  # best score first, then lower id
    return a[rank], b[rank]
