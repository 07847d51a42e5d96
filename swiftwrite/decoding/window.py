"""Writing past the model's context window: which tokens the model sees, as a pure function of position.

With a context limit C and a prompt of P tokens, the token at index i (prompt + output) is predicted from

    S[0:P] + S[s(i):i]

where s(i) = P until the sequence first exceeds C, and afterwards jumps every `stride` tokens so that the
P prompt tokens plus the R = (C - P) // 2 most recent ones are kept, at fresh positions 0.. . Because s is a
function of i alone, plain decoding, speculative decoding (whose tree never crosses a jump) and a resumed
run all predict every token from the same context, so losslessness and exact resume survive the rebuilds.
The cost: after a jump the model no longer sees the middle of the document, only the prompt and the
recent past.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base.errors import UserError

MIN_FREE = 64  # positions that must remain after the prompt for the window to be useful


@dataclass(frozen=True)
class Window:
    context: int  # C: the most tokens the model attends to
    prompt: int  # P

    def __post_init__(self):
        if self.context - self.prompt < MIN_FREE:
            raise UserError(
                f"the prompt is {self.prompt} tokens, which leaves fewer than {MIN_FREE} of the {self.context}-token "
                f"context for writing; shorten the prompt or raise --context (up to the model's window)."
            )

    @property
    def recent(self) -> int:
        return (self.context - self.prompt) // 2

    @property
    def stride(self) -> int:
        return self.context - self.prompt - self.recent + 1

    def span(self, i: int) -> tuple[int, int]:
        """For the token at index i: (s, b) where the context is S[0:P] + S[s:i] and b is the first index
        that needs a new context (the next rebuild)."""
        first = self.context + 1
        if i < first:
            return self.prompt, first
        k = (i - first) // self.stride
        b = first + k * self.stride
        return b - self.recent, b + self.stride
