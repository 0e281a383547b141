"""The grounded workload, `bench throughput --batch-sizes --speculative-config` and `bench ngram`: their records'
structure and the consistency of their counters (never their timings)."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from pagedq.bench.cli import main
from pagedq.bench.engine.grounded import INSTRUCTIONS, build_grounded, topic_paragraphs

K = 3
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def chat_llama_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny checkpoint with a chat template (the grounded workload applies the model's)."""
    folder = tmp_path_factory.mktemp("chat-llama")
    shutil.copytree(tiny_llama_dir, folder, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def test_grounded_prompts_are_real_documents_with_instructions(chat_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(chat_llama_dir)
    workload = build_grounded(tokenizer, 8, (40, 80), seed=1)
    assert workload == build_grounded(tokenizer, 8, (40, 80), seed=1)  # seeded
    assert workload.prompts != build_grounded(tokenizer, 8, (40, 80), seed=2).prompts
    topics = {title: paragraphs for title, paragraphs in topic_paragraphs()}
    kind_of = {instruction: kind for kind, instruction in INSTRUCTIONS}
    for prompt, kind, title in zip(workload.prompts, workload.kinds, workload.topics):
        text = tokenizer.decode(prompt)
        head = f"<s>user: Document: {title}\n\n"
        instruction = next(i for i in kind_of if text.endswith(f"\n\n{i}</s><s>assistant: "))
        assert text.startswith(head) and kind_of[instruction] == kind
        document = text[len(head) : -len(f"\n\n{instruction}</s><s>assistant: ")]
        # a run of whole, consecutive paragraphs of that topic, no longer than drawn unless one paragraph is
        assert document in "\n\n".join(topics[title])
        assert document.split("\n\n")[0] in topics[title] and document.split("\n\n")[-1] in topics[title]
        assert len(document) <= 80 * 3.6 or "\n\n" not in document
    assert set(workload.summary()["kinds"]) <= {"quote", "extract", "rewrite"}


def test_speculative_sweep_record_and_counters(chat_llama_dir, capsys):
    code = main(
        [
            "throughput",
            "--model",
            str(chat_llama_dir),
            "--workload",
            "grounded",
            "--batch-sizes",
            "1,2",
            "--num-prompts",
            "2",
            "--requests-per-seat",
            "1",
            "--input-len",
            "40:80",
            "--output-len",
            "24:24",
            "--speculative-config",
            json.dumps(SPEC),
            "--baseline",
            "hf",
        ]
    )
    assert code == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["workload"] == "grounded" and record["speculative_config"] == SPEC
    assert [run["batch_size"] for run in record["runs"]] == [1, 2] == record["batch_sizes"]
    total_drafts = 0
    for run in record["runs"]:
        base, spec = run["engine"], run["engine_speculative"]
        assert run["num_requests"] == 2 and run["identical_outputs"] == 2  # greedy: the same tokens
        assert 0 < spec["generated_tokens"] == base["generated_tokens"] <= 2 * 24
        assert base["num_draft_tokens"] == base["num_verify_rows"] == 0
        drafts, accepted, rows = (
            spec[key] for key in ("num_draft_tokens", "num_accepted_draft_tokens", "num_verify_rows")
        )
        assert 0 <= accepted <= drafts and rows <= drafts <= K * rows
        total_drafts += drafts
        if drafts:
            assert run["draft_acceptance_rate"] == accepted / drafts
            assert run["mean_accepted_tokens_per_step"] == accepted / rows
        # ABBA: two pairs (the default --repeats), batch 1 off first, batch 2 on first; the ratio is the pairs' mean
        first = "off" if run["batch_size"] == 1 else "on"
        assert run["order"] == ([first, "on", "on", "off"] if first == "off" else ["on", "off", "off", "on"])
        offs, ons = run["engine_runs"], run["engine_speculative_runs"]
        assert len(offs) == len(ons) == 2 and offs[0] == base and ons[0] == spec
        assert run["speedups"] == [on["output_tok_s"] / off["output_tok_s"] for off, on in zip(offs, ons)]
        assert run["speedup"] == sum(run["speedups"]) / 2
        assert all(r["generated_tokens"] == base["generated_tokens"] for r in offs + ons)
        assert [r["num_draft_tokens"] for r in ons] == [drafts, drafts]  # greedy: the same drafts both times
        if run["batch_size"] == 1:  # one sequence at a time: each step makes 1 + its accepted drafts final
            assert base["num_steps"] == base["generated_tokens"]
            assert spec["num_steps"] == spec["generated_tokens"] - accepted
            assert 0 < run["hf_prompt_lookup"]["generated_tokens"] <= 2 * 24
        else:
            assert "hf_prompt_lookup" not in run
        assert 0 < run["hf"]["generated_tokens"] <= 2 * 24
        assert run["engine_vs_hf"] == base["output_tok_s"] / run["hf"]["output_tok_s"]
    assert total_drafts > 0  # the counters were exercised


@pytest.mark.parametrize(
    "repeats,first_pair,expected",
    [(1, 0, "AB"), (1, 1, "BA"), (2, 0, "ABBA"), (2, 1, "BAAB"), (3, 0, "ABBAAB")],
)
def test_the_sweep_order_alternates(repeats, first_pair, expected):
    from pagedq.bench.engine.speculative import run_order

    assert "".join("B" if on else "A" for on in run_order(repeats, first_pair)) == expected


def test_bench_ngram_agrees_with_the_scan(capsys):
    code = main(["ngram", "--num-seqs", "6", "--history-len", "60:120", "--steps", "4", "--vocab-size", "50"])
    assert code == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["proposals_identical"] is True  # the proposer's drafts are the scan's, step after step
    assert record["num_seqs"] == 6 and 0 < record["mean_drafts_per_seq_step"] <= 4
    assert record["proposer_memory_mib"] > 0 and record["bytes_per_token"] > 0
    assert record["proposer_ms_per_step"] > 0 and record["scan_ms_per_step"] > 0


def test_a_bad_speculative_config_names_the_key(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["ngram", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'])
    assert exit_info.value.code == 2
    assert "num_speculative_tokens" in capsys.readouterr().err
