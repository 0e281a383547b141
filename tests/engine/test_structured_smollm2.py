"""SmolLM2-135M-Instruct extracting fields from 20 real documents under a JSON schema: greedy and seeded T = 1,
every output parses, validates with jsonschema and replays through an independent GrammarMatcher."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedq.engine import LLM, SamplingParams, StructuredOutputsParams
from tests.engine.structured_oracle import GrammarReplay

pytestmark = pytest.mark.slow

NAME = {"type": "string", "maxLength": 40}
PERSON = {
    "type": "object",
    "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 130}, "city": NAME},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
INVOICE = {
    "type": "object",
    "properties": {
        "vendor": NAME,
        "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
        "total": {"type": "number", "minimum": 0, "maximum": 1000000},
        "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]},
    },
    "required": ["vendor", "date", "total", "currency"],
    "additionalProperties": False,
}
EVENT = {
    "type": "object",
    "properties": {
        "title": NAME,
        "day": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]},
        "attendees": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 4},
    },
    "required": ["title", "day", "attendees"],
    "additionalProperties": False,
}
SENTIMENT = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "product": NAME,
        "stars": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["sentiment", "product", "stars"],
    "additionalProperties": False,
}
DOCUMENTS = [
    (PERSON, "Maria Lopez, 34, moved to Valencia last spring to open a bakery."),
    (PERSON, "Our new hire is Tom Becker. He is 28 years old and lives in Hamburg."),
    (PERSON, "At 71, retired teacher Ahmed Khan still volunteers at the Leeds library."),
    (PERSON, "Profile: Yuki Tanaka, age 45, based in Osaka, works as an architect."),
    (PERSON, "The winner, 19-year-old Priya Nair from Chennai, solved all ten puzzles."),
    (INVOICE, "Invoice from Acme Tools dated 2024-03-15. Amount due: 1,250.00 USD."),
    (INVOICE, "Rechnung: Müller GmbH, 2023-11-02, Gesamtbetrag 89.90 EUR."),
    (INVOICE, "Receipt - Blue Door Cafe - 2025-01-07 - total GBP 23.40"),
    (INVOICE, "Tokyo Electronics billed us 54000 JPY on 2024-08-30 for the monitors."),
    (INVOICE, "Payment of $310.75 to Northwind Traders was recorded on 2022-12-19."),
    (EVENT, "Team sync on Tuesday: Anna, Luis and Mei will review the roadmap."),
    (EVENT, "Board meeting moved to Friday. Attendees: Mr. Grant and Ms. Okafor."),
    (EVENT, "Saturday picnic in the park with Jack, Jill and Sam. Bring snacks!"),
    (EVENT, "The design review is on Monday; only Carla is required to attend."),
    (EVENT, "Hackathon kickoff Wednesday with Ravi, Olga, Ben and Chen."),
    (SENTIMENT, "Five stars! The Zen headphones are the best thing I bought this year."),
    (SENTIMENT, "The SwiftBlend mixer broke after two days. One star, avoid it."),
    (SENTIMENT, "The Aurora lamp is fine. Does the job, nothing special. Three stars."),
    (SENTIMENT, "I love my TrailRunner shoes, four stars, only the laces are short."),
    (SENTIMENT, "Terrible battery life on the Nimbus phone, two stars at most."),
]


def _prompt(tokenizer, schema: dict, document: str) -> str:
    keys = ", ".join(schema["properties"])
    message = f"Extract {keys} from this text as a JSON object.\n\nText: {document}"
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
    )


def test_smollm2_extractions_all_parse_and_validate(demo_model_dir):
    llm = LLM(demo_model_dir, max_num_seqs=40)
    tokenizer = llm.get_tokenizer()
    prompts, params = [], []
    for index, (schema, document) in enumerate(DOCUMENTS):
        constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=index % 2 == 1)
        for mode in (dict(temperature=0.0), dict(temperature=1.0, seed=index)):
            prompts.append(_prompt(tokenizer, schema, document))
            params.append(SamplingParams(max_tokens=160, structured_outputs=constraint, **mode))
    outputs = llm.generate(prompts, params)
    engine = llm.llm_engine
    replay = GrammarReplay(tokenizer, engine.model_config.vocab_size)
    stops = list(engine.model_config.eos_token_ids)
    for param, output in zip(params, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion
        value = json.loads(completion.text)
        jsonschema.validate(value, param.structured_outputs.schema)
        assert replay.refused(param.structured_outputs, completion.token_ids, stops) == []
    greedy = [json.loads(o.outputs[0].text) for o in outputs[::2]]
    assert greedy[0]["name"].startswith("Maria") and greedy[5]["currency"] == "USD"  # the model reads the text
