"""`pdserve bench` against a stub OpenAI server on a real uvicorn over loopback: the stub's answer
depends on the prompt (tokens, an HTTP 500, an error event, a dropped connection, a stream that never
ends), so the counts are exact; a stalled stream is released by the client's timeout, not waited out."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from benchmarks.local_cluster import served_app
from router.cli import main


def stub_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        words = (await request.json())["prompt"].split()
        return {"tokens": list(range(len(words))), "count": len(words), "max_model_len": 4096}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt, max_tokens = body["prompt"], body["max_tokens"]
        if prompt.startswith("http500"):
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)

        async def events():
            for i in range(max_tokens):
                if prompt.startswith("drop") and i == 2:
                    raise RuntimeError("the stub drops the connection mid-stream")
                if prompt.startswith("error") and i == 1:
                    yield f"data: {json.dumps({'error': {'message': 'engine died', 'code': 500}})}\n\n"
                    return
                if prompt.startswith("odd") and i == 1:
                    yield 'data: {"choices": [7]}\n\n'  # a choice that is not an object
                    continue
                if prompt.startswith("stall") and i == 1:
                    await asyncio.Event().wait()  # never set: only the client's timeout ends this request
                chunk = {"id": "c", "object": "text_completion", "model": "stub-model",
                         "choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": max_tokens,
                     "total_tokens": len(prompt.split()) + max_tokens}
            yield f"data: {json.dumps({'id': 'c', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def stub_url():
    with served_app(stub_app()) as url:
        yield url


def write_prompts(path, prompts: list[tuple[str, int]]) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "output_tokens": n}) + "\n" for p, n in prompts))
    return str(path)


def bench(url: str, dataset: str, *extra: str) -> None:
    main(["bench", "--base-url", url, "--dataset-name", "jsonl", "--dataset-path", dataset, "--disable-tqdm",
          "--request-timeout", "2", *extra])


def test_counts_tokens_and_failures(stub_url, tmp_path, capsys):
    dataset = write_prompts(tmp_path / "p.jsonl", [
        ("one two three", 5), ("four five", 3), ("http500 x", 4), ("error y", 4), ("drop z", 6), ("stall w", 4),
        ("odd v", 3)])
    result_path = tmp_path / "result.json"
    bench(stub_url, dataset, "--num-prompts", "7", "--request-rate", "inf", "--goodput", "tpot:60000",
          "--result-json", str(result_path), "--plot", str(tmp_path / "plots"))
    r = json.loads(result_path.read_text())
    assert (r["completed"], r["failed"], r["num_prompts"], r["model_id"]) == (2, 5, 7, "stub-model")
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (5, 8)
    assert r["output_lens"] == [5, 3, 0, 0, 0, 0, 0]
    assert [len(gaps) for gaps in r["itls"][:2]] == [4, 2]  # one gap per event after the first
    errors = r["errors"]
    assert errors[:2] == ["", ""]
    assert errors[2].startswith("HTTP 500") and "engine died" in errors[3]
    assert "RemoteProtocolError" in errors[4] and "ReadTimeout" in errors[5]
    assert errors[6].startswith("malformed event")
    assert r["request_goodput"] * r["duration"] == pytest.approx(2)  # a generous TPOT objective: both met
    for key in ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
                "p99_itl_ms", "p99_tpot_ms", "mean_e2el_ms", "total_token_throughput"):
        assert r[key] > 0, key
    assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "Successful requests:" in out and "Failed requests:" in out


def test_rate_sweep_writes_one_result_per_rate_and_the_sweep_plot(stub_url, tmp_path):
    dataset = write_prompts(tmp_path / "p.jsonl", [("a b", 3), ("c d e", 2)])
    bench(stub_url, dataset, "--num-prompts", "4", "--request-rate", "50", "100", "--max-concurrency", "2",
          "--result-json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "plots"))
    for rate in (50, 100):
        r = json.loads((tmp_path / f"r-rate{rate}.json").read_text())
        assert (r["request_rate"], r["completed"], r["failed"], r["max_concurrency"]) == (rate, 4, 0, 2)
        assert r["total_output_tokens"] == 3 + 2 + 3 + 2
    assert (tmp_path / "plots" / "rate_sweep.png").stat().st_size > 0


def test_a_dead_server_is_a_clear_error_not_a_hang(tmp_path, capsys):
    from benchmarks.local_cluster import free_port

    dataset = write_prompts(tmp_path / "p.jsonl", [("a b", 3)])
    with pytest.raises(SystemExit) as exit_info:
        bench(f"http://127.0.0.1:{free_port()}", dataset, "--num-prompts", "1", "--model", "m")
    assert exit_info.value.code == 2
    assert "pdserve bench: error:" in capsys.readouterr().err


def test_bad_flags_name_the_value(tmp_path, capsys):
    for flags, needle in ((["--request-rate", "0"], "request rate must be positive"),
                          (["--request-rate", "fast"], "requests/s or inf"),
                          (["--metric-percentiles", "50,101"], "(0, 100]"),
                          (["--goodput", "itl:3"], "--goodput 'itl:3'")):
        with pytest.raises(SystemExit):
            main(["bench", "--base-url", "http://127.0.0.1:1", "--disable-tqdm", *flags])
        assert needle in capsys.readouterr().err


def test_chat_endpoint_against_the_router_app(tmp_path):
    """Random token ids become text through the server's /detokenize; the real router app (before
    stand-in workers that answer each request in one delta) counts the tokens in its usage."""
    from benchmarks import router_stand_in as stand_in

    with stand_in.served(stand_in.state(max_model_len=512)) as url:
        main(["bench", "--base-url", url, "--endpoint", "/v1/chat/completions", "--num-prompts", "3",
              "--random-input-len", "20", "--random-output-len", "5", "--ignore-eos", "--disable-tqdm",
              "--metric-percentiles", "50,99.9", "--result-json", str(tmp_path / "chat.json")])
    r = json.loads((tmp_path / "chat.json").read_text())
    assert (r["completed"], r["failed"], r["total_output_tokens"], r["model_id"]) == (3, 0, 15, "stand-in")
    assert r["backend"] == "openai-chat" and r["itls"] == [[], [], []]  # one event each: no gap
    assert "p99.9_ttft_ms" in r and "p90_ttft_ms" not in r
