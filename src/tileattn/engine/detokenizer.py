"""Incremental detokenization and stop strings, for all sequences of a step at once.

A token's text can depend on its neighbours (byte-level BPE splits a UTF-8 character over
tokens; SentencePiece drops a leading space at the start of a decode), so each step decodes a
short window of tokens already seen plus the new one, and keeps the difference. A window whose
text ends in U+FFFD (an incomplete character) is not consumed: the next token completes it.
"""

from __future__ import annotations


def detokenize(tokenizer, seqs, ends=None, final: bool = False) -> list[str]:
    """Append the text of each sequence's newest tokens (up to ends[i], default all) to seq.text;
    returns the added text. final: the sequences end here (offline runs decode their text once, at
    the end): a trailing incomplete character is dropped instead of waited for, which leaves the
    text a token-by-token run would have ended with (it never shows an incomplete last character)."""
    if ends is None:
        ends = [len(seq.token_ids) for seq in seqs]
    groups: dict[bool, list] = {}
    for seq, end in zip(seqs, ends):
        groups.setdefault(seq.params.skip_special_tokens, []).append((seq, end))
    added = {}
    for skip, group in groups.items():
        before = tokenizer.decode_batch([s.token_ids[s.prefix_offset:s.read_offset] for s, _ in group], skip)
        after = tokenizer.decode_batch([s.token_ids[s.prefix_offset:end] for s, end in group], skip)
        for (seq, end), old, new in zip(group, before, after):
            if final:
                new = new.rstrip("\ufffd")
            if len(new) > len(old) and not new.endswith("\ufffd"):
                added[seq] = new[len(old):]
                seq.prefix_offset, seq.read_offset = seq.read_offset, end
            else:
                added[seq] = ""
            seq.text += added[seq]
    return [added[s] for s in seqs]


def find_stop(seq, new_text: str) -> str | None:
    """If a stop string now occurs in seq.text (searching only where new_text could complete
    one), cut the text before it and return the string; otherwise None."""
    stops = seq.params.stop
    if not stops or not new_text:
        return None
    longest = max(len(s) for s in stops)
    start = max(len(seq.text) - len(new_text) - longest + 1, 0)
    best = None
    for stop in stops:
        at = seq.text.find(stop, start)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    if best is None:
        return None
    seq.text = seq.text[:best[0]]
    return best[1]


def visible_text_length(seq) -> int:
    """Characters that may be shown now: all once finished, else all but those that could still
    be the start of a stop string."""
    if seq.finished or not seq.params.stop:
        return len(seq.text)
    return max(len(seq.text) - (max(len(s) for s in seq.params.stop) - 1), 0)
