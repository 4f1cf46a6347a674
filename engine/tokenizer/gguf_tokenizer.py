"""Tokenizer built from GGUF metadata, reproducing llama.cpp's `llama_tokenize` / `token_to_piece`.

Encoding is llama.cpp's, step for step:
1. split the text on special tokens (control, user-defined, unknown), longest token first over the whole
   text (llama.cpp's `tokenizer_st_partition`; not the leftmost-longest match `tokenizers` would do);
2. each remaining fragment goes through the vocabulary's model (hf_build.py): byte-level BPE (`gpt2`) or
   SentencePiece BPE (`llama`, spaces as U+2581, an optional leading space after BOS/special tokens).

Decoding renders token pieces as bytes and joins them, so byte-fallback tokens reassemble into UTF-8.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import numpy as np

from engine.errors import ModelLoadError, UnsupportedModel
from engine.tokenizer import hf_build
from engine.tokenizer.hf_build import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED

SPACE = "\u2581"  # SentencePiece's visible space

# Tokens llama.cpp treats as end-of-generation by their text (llama-vocab.cpp), besides eos/eot/eom ids; not its
# "</s>" (added for one OCR model; Gemma 3 has it as a text token, and llama.cpp then takes it out again for Gemma 4).
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>")
# gpt-oss's Harmony (o200k_harmony): a reply is several messages, each closed by <|end|>; only <|return|> (the
# answer is done) and <|call|> (a tool call is) end it. llama.cpp drops <|end|> from the set where both of those are
# there, and renders these message markers as text (user-defined), so a reply's channels can be read from its text.
# Gemma 4's thought channel and call markup are rendered too (llama.cpp keeps them as its chat parser's "preserved
# tokens"): the reply's readers (engine/thinking/stream.py, engine/templates/tools.py) find them in the text.
_REPLY_MARKERS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>",
                  "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>')
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>",
              "<\uff5cend\u2581of\u2581sentence\uff5c>")
_FIM_EOG = {  # FIM pad / repo / file-separator tokens also end generation in llama.cpp
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<PAD>"),
    "tokenizer.ggml.fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>"),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",),
}

_FIM_OTHER = {  # FIM prefix / suffix / middle: not end-of-generation, but control-typed when found by text
    "tokenizer.ggml.fim_pre_token_id": ("<|fim_prefix|>", "<fim-prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>"),
    "tokenizer.ggml.fim_suf_token_id": ("<|fim_suffix|>", "<fim-suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>"),
    "tokenizer.ggml.fim_mid_token_id": ("<|fim_middle|>", "<fim-middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>"),
}

_SUPPORTED = ("gpt2", "llama", "gemma4")
_SPACES_AS_U2581 = ("llama", "gemma4")  # vocabularies that write spaces as U+2581 and bytes as <0xNN>
_HIDDEN = (CONTROL, UNKNOWN, UNUSED)  # token types llama.cpp's token_to_piece drops unless asked for specials


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _bytes_to_unicode()


class Tokenizer:
    """Text <-> token ids for one model, as llama.cpp tokenizes (special tokens parsed in text)."""

    def __init__(self, *, kind: str, tokens: list[str], vocab: dict[str, int], attrs: np.ndarray, hf,
                 bos_id: int | None, eos_id: int | None, eog_ids: frozenset[int], add_bos: bool,
                 add_eos: bool, add_space_prefix: bool, rstrip_ids: frozenset[int] = frozenset(),
                 parses_specials: bool = False):
        self.kind = kind  # "gpt2" | "llama" | "gemma4"
        self._tokens = tokens
        self._attrs = attrs  # (n_vocab,) int32, GGUF token types after llama.cpp's fix-ups
        self._hf = hf
        self._bos, self._eos, self._eog = bos_id, eos_id, eog_ids
        self._add_bos, self._add_eos, self._add_space_prefix = add_bos, add_eos, add_space_prefix
        self._pieces: list[bytes | None] = [None] * len(tokens)  # rendered lazily
        specials = np.flatnonzero(np.isin(attrs, (CONTROL, USER_DEFINED, UNKNOWN))).tolist()
        self._special_matcher = _SpecialMatcher([(tokens[i], i) for i in specials])
        self._rstrip = rstrip_ids  # special tokens that swallow the whitespace after them (llama.cpp's RSTRIP)
        # A tokenizer.json's own tokenizer (hf_json.py) finds its added tokens itself: encode hands it the text whole.
        self._parses_specials = parses_specials

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        if kind is None:
            raise ModelLoadError("GGUF metadata has no tokenizer.ggml.model")
        if kind not in _SUPPORTED:
            raise UnsupportedModel(f"tokenizer model {kind!r} is not supported (supported: {', '.join(_SUPPORTED)})")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelLoadError("GGUF metadata has no tokenizer.ggml.tokens")
        if "" in tokens:  # llama.cpp renames empty tokens
            tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        n = len(tokens)
        types = meta.get("tokenizer.ggml.token_type")
        attrs = np.full(n, NORMAL, dtype=np.int32) if types is None else np.array(types, dtype=np.int32)
        if len(attrs) != n:
            raise ModelLoadError(f"tokenizer.ggml.token_type has {len(attrs)} entries for {n} tokens")
        vocab = {t: i for i, t in enumerate(tokens)}

        def key_id(key: str, default: int | None) -> int | None:
            v = meta.get(key)
            return int(v) if v is not None and 0 <= int(v) < n else default

        pre = meta.get("tokenizer.ggml.pre")
        if kind == "gpt2" and not pre:
            warnings.warn("GGUF metadata has no tokenizer.ggml.pre: using llama.cpp's 'default' pre-tokenizer; "
                          "token ids may differ from the model's own tokenizer", stacklevel=2)
        pre = str(pre or "default")
        # defaults when a key is absent are llama.cpp's (per vocabulary type)
        if kind in _SPACES_AS_U2581:
            bos, eos = key_id("tokenizer.ggml.bos_token_id", 1), key_id("tokenizer.ggml.eos_token_id", 2)
            add_bos, space_prefix = True, kind == "llama"
        else:
            bos, eos = key_id("tokenizer.ggml.bos_token_id", 11), key_id("tokenizer.ggml.eos_token_id", 11)
            add_bos, space_prefix = pre in hf_build.PRE_ADDS_BOS, False
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", space_prefix))
        eog = end_of_generation(vocab, attrs, eos, key_id)
        rstrip = _rstrip_ids(meta, vocab, attrs)

        if kind == "gpt2":
            merges = meta.get("tokenizer.ggml.merges")
            if merges is None:
                raise ModelLoadError("gpt2 tokenizer without tokenizer.ggml.merges")
            hf = hf_build.build_gpt2(vocab, list(merges), pre)
        elif kind == "gemma4":
            merges = meta.get("tokenizer.ggml.merges")
            if merges is None:
                raise ModelLoadError("gemma4 tokenizer without tokenizer.ggml.merges")
            unk = key_id("tokenizer.ggml.unknown_token_id", None)
            hf = hf_build.build_gemma4(vocab, list(merges), tokens[unk] if unk is not None else None)
        else:
            scores = meta.get("tokenizer.ggml.scores")
            scores = np.zeros(n, dtype=np.float32) if scores is None else np.asarray(scores, dtype=np.float32)
            unk = key_id("tokenizer.ggml.unknown_token_id", 0)
            hf = hf_build.build_spm(tokens, vocab, scores, attrs, tokens[unk] if unk is not None else None)
        return cls(kind=kind, tokens=tokens, vocab=vocab, attrs=attrs, hf=hf, bos_id=bos, eos_id=eos,
                   eog_ids=frozenset(eog), add_bos=add_bos, add_eos=add_eos, add_space_prefix=space_prefix,
                   rstrip_ids=rstrip)

    # ------------------------------------------------------------------ properties

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int | None:
        return self._eos

    @property
    def eog_ids(self) -> frozenset[int]:
        return self._eog

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)  # no Python dict: 262k entries cost ~30 MB

    def id_to_token(self, token_id: int) -> str:
        return self._tokens[token_id]

    def is_special(self, token_id: int) -> bool:
        """Control tokens (and unknown / unused ones): decode() shows them only when skip_special is False."""
        return int(self._attrs[token_id]) in _HIDDEN

    # ------------------------------------------------------------------ encode

    def encode(self, text: str, add_bos: bool | None = None, add_eos: bool | None = None) -> list[int]:
        """Token ids of `text`, special-token text parsed; BOS/EOS per the metadata unless given."""
        add_bos = self._add_bos if add_bos is None else add_bos
        add_eos = self._add_eos if add_eos is None else add_eos
        out: list[int] = [self._bos] if add_bos and self._bos is not None else []
        if self._parses_specials:
            out.extend(self._hf.encode(text, add_special_tokens=False).ids if text else [])
            return out + ([self._eos] if add_eos and self._eos is not None else [])
        parts: list[str | int] = []
        prev_special = True  # SentencePiece prefixes a space to the first fragment and after special tokens
        for p in self._special_matcher.split(text) if text else []:
            if isinstance(p, int):
                prev_special = True
                parts.append(p)
                continue
            if parts and parts[-1] in self._rstrip:
                p = p.lstrip(_C_SPACE)
                if not p:
                    continue  # nothing left of the fragment
            if self.kind in _SPACES_AS_U2581:
                p = ((" " + p) if self._add_space_prefix and prev_special else p).replace(" ", SPACE)
            parts.append(p)
            prev_special = False
        # one call per fragment: encode_batch would start tokenizers' thread pool (and its fork warnings)
        encoded = iter([self._hf.encode(p, add_special_tokens=False) for p in parts if isinstance(p, str)])
        for p in parts:
            out.extend([p] if isinstance(p, int) else next(encoded).ids)
        if add_eos and self._eos is not None:
            out.append(self._eos)
        return out

    # ------------------------------------------------------------------ decode

    def piece_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        """The bytes one token renders to (llama.cpp's token_to_piece); b"" for hidden special tokens."""
        if skip_special and int(self._attrs[token_id]) in _HIDDEN:
            return b""
        piece = self._pieces[token_id]
        if piece is None:
            piece = self._pieces[token_id] = self._render(token_id)
        return piece

    def _render(self, token_id: int) -> bytes:
        text, attr = self._tokens[token_id], int(self._attrs[token_id])
        if attr in (CONTROL, UNKNOWN, USER_DEFINED, UNUSED):
            return text.encode("utf-8")
        if self.kind in _SPACES_AS_U2581:
            if attr == BYTE and len(text) == 6 and text.startswith("<0x"):
                return bytes([int(text[3:5], 16)])
            return text.replace(SPACE, " ").encode("utf-8")
        # byte-level BPE: each character stands for one byte; anything outside that alphabet is kept as UTF-8
        return b"".join(bytes([_BYTE_OF_CHAR[ch]]) if ch in _BYTE_OF_CHAR else ch.encode("utf-8") for ch in text)

    def strips_leading_space(self, token_ids: list[int], index: int) -> bool:
        """Whether the piece at `index` loses one leading space: the first text token when encode added it."""
        if not self._add_space_prefix or self.kind != "llama":
            return False
        first = 1 if token_ids and token_ids[0] == self._bos else 0
        return index == first

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids` (special tokens shown unless skip_special), byte pieces joined before UTF-8 decoding.

        With a SentencePiece space prefix, the first text token loses the space encode() added, also after a
        BOS (llama.cpp keeps it there), so decode(encode(text)) == text."""
        ids = [int(i) for i in ids]
        chunks = [self.piece_bytes(i, skip_special) for i in ids]
        first = 1 if ids and ids[0] == self._bos else 0
        if first < len(chunks) and chunks[first].startswith(b" ") and self.strips_leading_space(ids, first):
            chunks[first] = chunks[first][1:]
        return b"".join(chunks).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, bos={self._bos}, eos={self._eos})"


_C_SPACE = " \t\n\v\f\r"  # what C's isspace calls whitespace (llama.cpp strips with it)


def _rstrip_ids(meta: dict, vocab: dict[str, int], attrs: np.ndarray) -> frozenset[int]:
    """The special tokens after which llama.cpp drops whitespace. It decides by the model's name, not by anything
    in the vocabulary (llama-vocab.cpp): in a Phi-3 model every special token but <unk>, <s> and <|endoftext|>,
    and </s>. Nothing for any other model."""
    name = str(meta.get("general.name", "")).lower()
    if "phi-3" not in name and "phi3" not in name:
        return frozenset()
    ids = set(np.flatnonzero(np.isin(attrs, (CONTROL, USER_DEFINED, UNKNOWN))).tolist())
    ids |= {vocab["</s>"]} if "</s>" in vocab else set()
    return frozenset(ids - {vocab.get(t) for t in ("<unk>", "<s>", "<|endoftext|>")})


def end_of_generation(vocab: dict[str, int], attrs: np.ndarray, eos: int | None, key_id) -> set[int]:
    """llama.cpp's end-of-generation set: eos, eot, eom, FIM pad/repo/sep and tokens with EOG-looking text, less
    Harmony's <|end|>. Tokens it finds by their text it also retypes as control, Harmony's markers as user-defined
    (`attrs` is updated in place)."""
    eog: set[int] = set()
    by_text: set[int] = set()

    def find_text(texts: tuple[str, ...]) -> int | None:
        tid = next((vocab[t] for t in texts if t in vocab), None)
        if tid is not None:
            by_text.add(tid)
        return tid

    eot = key_id("tokenizer.ggml.eot_token_id", None)
    eot = find_text(_EOT_TEXTS) if eot is None else eot
    eom = key_id("tokenizer.ggml.eom_token_id", None)
    eom = find_text(("<|eom_id|>",)) if eom is None else eom
    for key, texts in _FIM_EOG.items():
        fid = key_id(key, None)
        fid = find_text(texts) if fid is None else fid
        if fid is not None:
            eog.add(fid)
    for key, texts in _FIM_OTHER.items():
        if key_id(key, None) is None:
            find_text(texts)
    for t in _EOG_TEXTS:
        if t in vocab:
            eog.add(vocab[t])
            by_text.add(vocab[t])
    for i in by_text:
        attrs[i] = CONTROL
    eog.update(x for x in (eos, eot, eom) if x is not None)
    for t in _REPLY_MARKERS:
        if t in vocab:
            attrs[vocab[t]] = USER_DEFINED
    if all(t in vocab and vocab[t] in eog for t in ("<|return|>", "<|call|>", "<|end|>")) or \
            all(t in vocab and vocab[t] in eog for t in ("<|calls|>", "<|flush|>", "<|end|>")):
        eog.discard(vocab["<|end|>"])
        attrs[vocab["<|end|>"]] = USER_DEFINED
    return eog


class _SpecialMatcher:
    """llama.cpp's special-token partition: for each token, longest first, split every remaining text fragment
    on all of its occurrences. Tokens are pre-filtered by their first two characters so a 6k-token special
    set costs little on text that mentions none of them."""

    def __init__(self, specials: list[tuple[str, int]]):
        # longest first; equal lengths by id (llama.cpp's std::sort leaves that order unspecified)
        self._order = sorted(specials, key=lambda s: (-len(s[0]), s[1]))
        self._groups: dict[str, list[tuple[int, str, int]]] = {}
        for rank, (text, tid) in enumerate(self._order):
            self._groups.setdefault(text[:2], []).append((rank, text, tid))

    def split(self, text: str) -> list[str | int]:
        found = [m for key, group in self._groups.items() if key in text for m in group if m[1] in text]
        parts: list[str | int] = [text]
        for _, tok, tid in sorted(found):
            nxt: list[str | int] = []
            for p in parts:
                if isinstance(p, int) or tok not in p:
                    nxt.append(p)
                    continue
                pieces = p.split(tok)
                for j, piece in enumerate(pieces):
                    if j:
                        nxt.append(tid)
                    if piece:
                        nxt.append(piece)
            parts = nxt
        return parts
