"""Incremental detokenization and stop strings, for all sequences of a step at once.

A token's text can depend on its neighbours (byte-level BPE splits a UTF-8 character over
tokens; SentencePiece drops a leading space at the start of a decode), so each step decodes a
short window of tokens already seen plus the new one, and keeps the difference. While more tokens
may come, a window whose text can still change is not consumed, so no text is ever taken back:
 - it ends in U+FFFD: an incomplete character, which the next bytes may complete;
 - its last token is a SentencePiece byte-fallback token <0xNN>: that decoder turns a whole run of
   byte tokens into one U+FFFD per byte when the run is not valid UTF-8, so a later byte can undo a
   character the run already spelled (<0xE4><0xB8><0xAD> is one character; add <0xE4> and it is
   four U+FFFD).
When a sequence ends (its finish_reason is set), its window is consumed whatever it decodes to:
the final text is what the tokenizer decodes, invalid or incomplete bytes at the end included as
U+FFFD, the same as ``tokenizer.decode(output ids)``.
The first window starts in the prompt (up to 6 of its last tokens, for a first token's leading
space), unless those decode to text ending in U+FFFD (the prompt ends inside a character, or in a
SentencePiece byte run the window cuts): the output is then decoded without them.
"""

from __future__ import annotations

import weakref

from .reasoning import content_start

# tokenizer -> (ids of the <0xNN> byte-fallback tokens, ids of special tokens); empty byte ids for
# vocabularies without byte fallback (byte-level BPE), which then need no token scan.
_vocab_facts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def detokenize(tokenizer, seqs, ends=None) -> list[str]:
    """Append the text of each sequence's newest tokens (up to ends[i], default all) to seq.text;
    returns the added text. A sequence whose finish_reason is set ends at ends[i]: its remaining
    tokens are decoded to the end, an incomplete or invalid character as U+FFFD, instead of being
    held back for tokens that will not come."""
    if ends is None:
        ends = [len(seq.token_ids) for seq in seqs]
    byte_ids, special_ids = _byte_tokens(tokenizer)
    groups: dict[bool, list] = {}
    for seq, end in zip(seqs, ends):
        groups.setdefault(seq.params.skip_special_tokens, []).append((seq, end))
    added = {}
    for skip, group in groups.items():
        before = tokenizer.decode_batch([s.token_ids[s.prefix_offset:s.read_offset] for s, _ in group], skip)
        after = tokenizer.decode_batch([s.token_ids[s.prefix_offset:end] for s, end in group], skip)
        for (seq, end), old, new in zip(group, before, after):
            if seq.read_offset == seq.num_prompt_tokens and old.endswith("\ufffd"):
                # The prompt's context tokens end unsettled: inside a character, or (SentencePiece)
                # in a run of byte tokens that the context starts inside of, which decodes to one
                # U+FFFD per byte. The output's first bytes would join that run (its characters
                # then U+FFFD too) or complete a character whose text is the prompt's, and the
                # difference from the context's text would not be the output's text. The output
                # is decoded without the prompt instead, as tokenizer.decode(output ids) does.
                seq.prefix_offset = seq.read_offset
                old, new = "", tokenizer.decode(seq.token_ids[seq.read_offset:end], skip)
            # Text that later tokens may still change waits for them, unless none will come.
            unsettled = new.endswith("\ufffd") or (byte_ids and _ends_in_byte_token(
                seq.token_ids, seq.prefix_offset, end, byte_ids, special_ids if skip else ()))
            if len(new) > len(old) and (seq.finish_reason is not None or not unsettled):
                added[seq] = new[len(old):]
                seq.prefix_offset, seq.read_offset = seq.read_offset, end
            else:
                added[seq] = ""
            seq.text += added[seq]
    return [added[s] for s in seqs]


def finish(tokenizer, seqs, ends) -> None:
    """Sequences that finished this step with text not decoded yet (held back, or never decoded
    while they ran: offline runs without stop strings) get it: detokenize up to ends[i] (the stop
    token, which adds no text, excluded), then cut at a stop string that this text completes;
    finish_reason becomes "stop" and stop_reason the string then."""
    for seq, new_text in zip(seqs, detokenize(tokenizer, seqs, ends)):
        stop = find_stop(seq, new_text)
        if stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop


def find_stop(seq, new_text: str) -> str | None:
    """If new_text completes a stop string in seq.text (an occurrence that ends inside new_text;
    the earliest one if several do; a content_stop only in the content, from seq.content_from,
    which the first call that can tell sets), cut the text before it (after it with
    include_stop_str_in_output) and return the string; otherwise None. None while the sequence has
    fewer than min_tokens output tokens: a stop string completed then is passed over, also later
    (each string is searched from where new_text could complete it, not from where the longest
    could, which would find a shorter one completed before)."""
    params = seq.params
    if not new_text or not (params.stop or params.content_stop):
        return None
    if params.content_stop and seq.content_from is None:  # before min_tokens' check: </think> may come first
        seq.content_from = content_start(seq.text, params.reasoning, len(seq.text) - len(new_text))
    if seq.num_output_tokens < params.min_tokens:
        return None
    searches = [(stop, 0) for stop in params.stop or ()]
    if seq.content_from is not None:
        searches += [(stop, seq.content_from) for stop in params.content_stop]
    best = None
    for stop, begin in searches:
        at = seq.text.find(stop, max(len(seq.text) - len(new_text) - len(stop) + 1, begin))
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    if best is None:
        return None
    at, stop = best
    seq.text = seq.text[:at + (len(stop) if seq.params.include_stop_str_in_output else 0)]
    return stop


def visible_text_length(seq) -> int:
    """Characters that may be shown now: all once finished, else all but those that could still
    be the start of a stop string."""
    stop, content_stop = seq.params.stop, seq.params.content_stop
    if seq.finished or not (stop or content_stop):
        return len(seq.text)
    longest = max(len(s) for stops in (stop, content_stop) if stops for s in stops)
    return max(len(seq.text) - (longest - 1), 0)


def _byte_tokens(tokenizer) -> tuple[frozenset, frozenset]:
    """(ids of the tokenizer's <0xNN> byte-fallback pieces, ids of its special tokens), looked up
    once per tokenizer: at most 512 piece lookups, not a vocabulary scan."""
    facts = _vocab_facts.get(tokenizer)
    if facts is None:
        backend = tokenizer.backend
        pieces = {f"<0x{b:02X}>" for b in range(256)} | {f"<0x{b:02x}>" for b in range(256)}
        byte_ids = frozenset(i for i in map(backend.token_to_id, pieces) if i is not None)
        special = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special) if byte_ids else frozenset()
        facts = _vocab_facts[tokenizer] = (byte_ids, special)
    return facts


def _ends_in_byte_token(ids, start: int, end: int, byte_ids, skipped) -> bool:
    """Whether the last token of ids[start:end] that the decode keeps (tokens in ``skipped`` are
    dropped before decoding, so byte tokens on both sides of one join into one run) is a byte token."""
    for i in range(end - 1, start - 1, -1):
        if ids[i] not in skipped:
            return ids[i] in byte_ids
    return False
