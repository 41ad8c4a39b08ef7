#!/usr/bin/env python3
"""Makes the fine-tuning fixtures under suites/data/, deterministically and without downloads.

    python scripts/make_sft_fixtures.py      # from the repository root; overwrites the files below

Writes
- suites/data/squad-sft.jsonl: 144 SQuAD-shaped rows made from this script's word lists with a
  fixed seed (id, title, context, question, answer, messages, prompt, completion, text);
- suites/data/squad-sft-validation.jsonl: 24 more rows of the same kind, drawn after the
  tokenizer's corpus (a validation split of its own);
- suites/data/squad-sft.parquet: the same rows as Parquet, as the Hugging Face Hub serves datasets
  (pyarrow, snappy, row groups of 64 rows: `messages` a list of structs);
- suites/data/tokenizer/: a 512-token byte-level BPE (tokenizer.json) trained with `tokenizers`
  on this script's own corpus only, saved by transformers' `save_pretrained` (tokenizer.json,
  tokenizer_config.json, chat_template.jinja); its ChatML template marks the assistant's
  content and <|im_end|> with {% generation %};
- suites/data/tokenizer-no-generation/: the same tokenizer with the same template less the
  generation markers (it renders the same text).
Rerunning it rewrites the same bytes (needs transformers 5, tokenizers and pyarrow; made with
5.24.0, 0.23.3 and 26.0.1).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import tempfile
from pathlib import Path
from typing import TypedDict

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SEED = 23
VALIDATION_ROWS = 24
ROWS = 144
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|startoftext|>", "<|pad|>"]
DATA = Path("suites/data")
SAVED_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]

# ChatML as Qwen2 writes it, with no default system message. The assistant's content and its
# <|im_end|> are inside {% generation %} so that return_assistant_tokens_mask marks them.
CHAT_TEMPLATE = """{%- for message in messages %}
    {%- if message['role'] == 'system' or message['role'] == 'user' %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
    {%- elif message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
            {{- message['content'] + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- raise_exception('Only system, user and assistant roles are supported, not ' + message['role'] + '.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def without_generation(template: str) -> str:
    """The template less its {%- generation %} lines, what was inside them dedented by a level."""
    lines: list[str] = []
    inside = False
    for line in template.splitlines(keepends=True):
        if "generation %}" in line:
            inside = "endgeneration" not in line
            continue
        lines.append(line.removeprefix("    ") if inside else line)
    return "".join(lines)


PLACES = [
    "Valdoria", "Brennmoor", "Zürich", "Kestrel Bay", "Ostrava Minor", "Lysander Falls",
    "Port Anselm", "Mirelle", "Havergate", "Saint-Élise", "Dunmarrow", "Orvieto Nuova",
    "Calder Reach", "Tessaly", "Grünwald", "Amberlin", "Norrhaven", "Quillon", "São Brandão",
    "Eskerfield",
]
FIRST = [
    "Renée", "José", "Björn", "Zoë", "Amara", "Tobias", "Ingrid", "Mateo", "Helena", "Otto",
    "Priya", "Céline", "Jonas", "Marguerite", "Idris", "Lucía", "Anselm", "Freya", "Emil", "Noor",
]
LAST = [
    "Halvorsen", "Moreau", "Quintero", "Albrecht", "Okafor", "Lindqvist", "Dubois", "Varga",
    "Castellano", "Whitcombe", "Nakamura", "Fontaine", "Østergaard", "Brandt", "Ferreira",
]
BUILDINGS = [
    "cathedral", "observatory", "harbour wall", "town hall", "library", "clock tower",
    "botanical garden", "railway station", "opera house", "market hall", "lighthouse", "bridge",
]
SHOPS = ["bakery", "bookshop", "café", "printing press", "pharmacy", "tannery", "school", "brewery"]
FOODS = ["almond cake", "crème brûlée", "smoked trout", "rye bread", "apple strudel", "hot chocolate"]
RIVERS = ["Aldra", "Vessel", "Rhona", "Skelde", "Marrow", "Tiber Minor", "Ouse-la-Grande"]
MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
]
ADJS = [
    "quiet", "narrow", "windswept", "naïve", "ornate", "crowded", "forgotten", "fertile",
    "rugged", "elegant", "modest", "sprawling", "damp", "sunlit",
]
NOUNS = [
    "façade", "charter", "archive", "guild", "festival", "canal", "orchard", "mill", "ferry",
    "treaty", "mural", "fountain", "regatta", "census",
]
SYSTEM_PROMPTS = [
    "You are a helpful assistant. Answer the question using the context.",
    "Answer with a short span copied from the context.",
    "You read passages about towns and answer questions about them — briefly.",
    "Réponds brièvement: answer in as few words as possible.",
]

Fact = tuple[str, str, str]  # sentence, question, answer (a substring of the sentence)


class Row(TypedDict):
    id: str
    title: str
    context: str
    question: str
    answer: str
    messages: list[dict[str, str]]
    prompt: str
    completion: str
    text: str


def person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


def year(rng: random.Random) -> str:
    return str(rng.randint(1412, 1987))


def fact(rng: random.Random, place: str) -> Fact:
    """One sentence about `place` with a question it answers and the answer span."""
    other = rng.choice([p for p in PLACES if p != place])
    kind = rng.randrange(7)
    if kind == 0:
        who, when = person(rng), year(rng)
        if rng.random() < 0.5:
            return f"{place} was founded in {when} by {who}.", f"When was {place} founded?", when
        return f"{place} was founded in {when} by {who}.", f"Who founded {place}?", who
    if kind == 1:
        b, who, when = rng.choice(BUILDINGS), person(rng), year(rng)
        s = f"The {b} of {place} was designed by {who} in {when}."
        return s, f"Who designed the {b} of {place}?", who
    if kind == 2:
        who, shop = person(rng), rng.choice(SHOPS)
        s = f"{who} moved to {other} in {rng.choice(MONTHS)} {year(rng)}, where they opened a {shop}."
        return s, f"What did {who} open in {other}?", f"a {shop}"
    if kind == 3:
        n, when = f"{rng.randint(2, 480)},{rng.randint(0, 999):03d}", year(rng)
        s = f"The population of {place} reached {n} in {when}."
        return s, f"What was the population of {place} in {when}?", n
    if kind == 4:
        river, km = rng.choice(RIVERS), f"{rng.randint(12, 940)} kilometres"
        s = f"The river {river} flows {km} from {place} to {other}."
        return s, f"How long is the river {river}?", km
    if kind == 5:
        cafe = f"Café {rng.choice(LAST)}"
        food = rng.choice(FOODS)
        s = f"{cafe} — famous for its {food} — opened near the {rng.choice(BUILDINGS)} in {year(rng)}."
        return s, f"What is {cafe} famous for?", food
    noun, who = rng.choice(NOUNS), person(rng)
    s = f"The {noun} of {place} was restored by {who} after the fire of {year(rng)}."
    return s, f"Who restored the {noun} of {place}?", who


def filler(rng: random.Random, place: str) -> str:
    """One sentence of prose about `place` that no question asks about."""
    kind = rng.randrange(8)
    if kind == 0:
        return f"{place} lies in a {rng.choice(ADJS)} valley north of {rng.choice(PLACES)}."
    if kind == 1:
        a, b = rng.sample(ADJS, 2)
        return f"Visitors often describe the {rng.choice(BUILDINGS)} as {a} and {b}."
    if kind == 2:
        return f"In {year(rng)}, a {rng.choice(ADJS)} winter closed the roads for {rng.randint(2, 11)} weeks."
    if kind == 3:
        return (
            f"Local historians — among them {person(rng)} — argue that the {rng.choice(NOUNS)}"
            f" was never as {rng.choice(ADJS)} as the {rng.choice(NOUNS)}."
        )
    if kind == 4:
        return f"The {rng.choice(ADJS)} {rng.choice(NOUNS)} near the {rng.choice(BUILDINGS)} still surprises visitors."
    if kind == 5:
        return f"Every {rng.choice(MONTHS)} the {rng.choice(NOUNS)} draws crowds from {rng.choice(PLACES)}."
    if kind == 6:
        return f"A ticket to the {rng.choice(BUILDINGS)} cost {rng.randint(2, 40)} € in {year(rng)}."
    a, b = rng.sample(ADJS, 2)
    return f"{person(rng)} wrote that {place} felt {a}, almost {b}."


def context_words(rng: random.Random) -> int:
    """A SQuAD-like long tail of lognormal word counts: most 20-120 (median 30), one in 33 150-400."""
    if rng.random() < 0.03:
        return min(400, max(150, round(math.exp(rng.gauss(math.log(200), 0.3)))))
    return min(120, max(20, round(math.exp(rng.gauss(math.log(30), 0.42)))))


def make_row(rng: random.Random) -> Row:
    place = rng.choice(PLACES)
    facts = [fact(rng, place) for _ in range(2)]
    sentences = [f[0] for f in facts]
    target = context_words(rng)
    while sum(len(s.split()) for s in sentences) < target:
        sentences.insert(rng.randrange(len(sentences) + 1), filler(rng, place))
    context = " ".join(sentences)
    (_, question, answer), (_, question2, answer2) = facts
    prompt = f"Context: {context}\nQuestion: {question}"
    messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 1 / 3 else []
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    if rng.random() < 1 / 8:
        messages += [
            {"role": "user", "content": f"Question: {question2}"},
            {"role": "assistant", "content": answer2},
        ]
    assert answer in context and answer2 in context
    return {
        "id": f"{rng.getrandbits(96):024x}",
        "title": place,
        "context": context,
        "question": question,
        "answer": answer,
        "messages": messages,
        "prompt": prompt,
        "completion": answer,
        "text": f"{context} {question} {answer}",
    }


def train_corpus(rows: list[Row], rng: random.Random) -> list[str]:
    """What the tokenizer learns from: each row's text and messages (role and content), and extra prose."""
    corpus: list[str] = []
    for row in rows:
        corpus.append(row["text"])
        for message in row["messages"]:
            corpus += [message["role"], message["content"]]
    for _ in range(300):  # paragraphs ending in a blank line, so that "\n\n" is a token as in real vocabularies
        place = rng.choice(PLACES)
        corpus.append("".join(s + "\n\n" for s in (filler(rng, place), fact(rng, place)[0], filler(rng, place))))
    return corpus


def train_tokenizer(corpus: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    assert list(ids.values()) == list(range(len(SPECIAL_TOKENS))) and tok.get_vocab_size() == VOCAB_SIZE
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>",
        pair="<|startoftext|> $A <|endoftext|> $B:1 <|endoftext|>:1",
        special_tokens=[("<|startoftext|>", ids["<|startoftext|>"]), ("<|endoftext|>", ids["<|endoftext|>"])],
    )
    return tok


def save_tokenizer(tok: Tokenizer, template: str, out: Path) -> None:
    """Saves through transformers (as a model's tokenizer is saved) and keeps SAVED_FILES."""
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token="<|startoftext|>",
        eos_token="<|im_end|>",  # as Qwen2's instruct tokenizers: generation ends at <|im_end|>
        pad_token="<|pad|>",
        chat_template=template,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        written = fast.save_pretrained(tmp)
        names = sorted(Path(p).name for p in written)
        assert set(SAVED_FILES) <= set(names), names
        out.mkdir(parents=True, exist_ok=True)
        for name in SAVED_FILES:
            shutil.copyfile(Path(tmp) / name, out / name)


def main() -> None:
    rng = random.Random(SEED)
    rows = [make_row(rng) for _ in range(ROWS)]
    DATA.mkdir(parents=True, exist_ok=True)
    with open(DATA / "squad-sft.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
    table = pa.Table.from_pylist([dict(row) for row in rows])
    pq.write_table(table, DATA / "squad-sft.parquet", compression="snappy", row_group_size=64)
    tok = train_tokenizer(train_corpus(rows, rng))
    with open(DATA / "squad-sft-validation.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for row in [make_row(rng) for _ in range(VALIDATION_ROWS)]:
            f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
    save_tokenizer(tok, CHAT_TEMPLATE, DATA / "tokenizer")
    save_tokenizer(tok, without_generation(CHAT_TEMPLATE), DATA / "tokenizer-no-generation")


if __name__ == "__main__":
    main()
