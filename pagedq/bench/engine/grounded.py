"""The input-grounded workload (issue 22): documents from Python's reference docs with instructions to quote,
extract from or rewrite them, as bulk document work asks; each prompt in the model's chat template.

The text is the standard library's `pydoc_data.topics` (about 465k characters in 79 topics): no download, the same
on every machine with the same Python (the record carries its version). A document is a run of consecutive
paragraphs of one topic, long enough for its drawn length; the drawing is seeded.
"""

from __future__ import annotations

import platform
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# (kind, instruction): what answers copy from the document, and how much
INSTRUCTIONS = (
    ("quote", "Copy the first three paragraphs of the document above exactly, word for word."),
    ("quote", "Quote every sentence of the document above that contains a word in double quotes, exactly as written."),
    ("extract", "Extract every code sample and grammar rule from the document above, exactly as written."),
    ("extract", "List every name in double quotes that the document above mentions, each with the sentence it is in."),
    ("rewrite", "Rewrite the document above as a bulleted list of its statements, keeping its own words."),
    ("rewrite", "Rewrite the document above in plain English for a beginner, keeping its examples unchanged."),
    ("rewrite", "Join the hard-wrapped lines of the document above into full paragraphs, keeping every word."),
)
CHARS_PER_TOKEN = 3.6  # English prose and code in SmolLM2's (GPT-2 style) tokenizer, about


@dataclass
class GroundedWorkload:
    prompts: list[list[int]]  # token ids, chat template applied
    kinds: list[str]  # quote / extract / rewrite, per prompt
    topics: list[str]

    def summary(self) -> dict[str, object]:
        lengths = [len(p) for p in self.prompts]
        return {
            "text": f"pydoc_data.topics of Python {platform.python_version()}",
            "mean_prompt_tokens": sum(lengths) / len(lengths) if lengths else 0.0,
            "max_prompt_tokens": max(lengths, default=0),
            "kinds": {kind: self.kinds.count(kind) for kind in sorted(set(self.kinds))},
        }


def topic_paragraphs() -> list[tuple[str, list[str]]]:
    """(title, paragraphs) per topic, in the topics' name order; a title is the topic's heading line."""
    from pydoc_data.topics import topics

    result = []
    for name in sorted(topics):
        paragraphs = [p.strip("\n") for p in topics[name].split("\n\n") if p.strip()]
        title = paragraphs[0].splitlines()[0] if paragraphs else name
        if len(paragraphs) > 1:
            result.append((title, paragraphs[1:] if set(paragraphs[0].splitlines()[-1]) <= {"*"} else paragraphs))
    return result


def draw_document(rng: random.Random, topics: list[tuple[str, list[str]]], target_chars: int) -> tuple[str, str]:
    """A run of consecutive paragraphs of one topic, about target_chars long: from a topic that has that much
    (any topic when none has), starting where that much follows (at least one paragraph)."""
    long_enough = [topic for topic in topics if sum(map(len, topic[1])) >= target_chars]
    title, paragraphs = rng.choice(long_enough or topics)
    remaining, starts = 0, []
    for index in range(len(paragraphs) - 1, -1, -1):
        remaining += len(paragraphs[index])
        if remaining >= target_chars:
            starts.append(index)
    start = rng.choice(starts) if starts else 0
    chosen: list[str] = []
    for paragraph in paragraphs[start:]:
        if chosen and sum(map(len, chosen)) + len(paragraph) > target_chars:
            break
        chosen.append(paragraph)
    return title, "\n\n".join(chosen)


def build_grounded(
    tokenizer: PreTrainedTokenizerBase, num_prompts: int, input_len: tuple[int, int], seed: int = 0
) -> GroundedWorkload:
    """num_prompts chat prompts: a document of about input_len tokens (drawn uniformly), then an instruction."""
    rng = random.Random(seed)
    topics = topic_paragraphs()
    prompts, kinds, titles = [], [], []
    for _ in range(num_prompts):
        target = int(rng.randint(*input_len) * CHARS_PER_TOKEN)
        title, document = draw_document(rng, topics, target)
        kind, instruction = rng.choice(INSTRUCTIONS)
        message = f"Document: {title}\n\n{document}\n\n{instruction}"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )
        if not isinstance(text, str):
            raise TypeError(f"the chat template gave a {type(text).__name__}, expected text")
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
        kinds.append(kind)
        titles.append(title)
    return GroundedWorkload(prompts, kinds, titles)
