"""``podium run-batch -i requests.jsonl -o results.jsonl``: OpenAI's batch file format, offline.

Each input line is ``{"custom_id", "method": "POST", "url", "body"}``; each result line is
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``. Lines are
sent to the server app's own routes in-process (through its ASGI interface, never a socket), so
every endpoint the server has (``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``
where it exists) works here without a change; a URL the app has no route for gets an error line
naming it. A bad line (not JSON, no ``custom_id``, a repeated one, not POST) gets an error line
and the rest go on.

Resumable: a result is appended to the output as soon as it is ready (one ``write`` per line). A
rerun first repairs the output (a half-written last line from a crash is cut off), then skips
every input line that already has a result, so each ``custom_id`` appears exactly once. Error
lines of inputs without a usable ``custom_id`` carry ``input_line`` (1-based) for the same purpose.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from podium.engine_args import engine_config
from podium.engine_flags import add_engine_flags, engine_kwargs

from .logs import configure_logging
from .settings import ServerSettings

BASE_URL = "http://run-batch"


@dataclass
class BatchLine:
    number: int  # 1-based line number in the input
    custom_id: str | None
    url: str = ""
    body: Any = None
    error: tuple[str, str] | None = None  # (code, message) when the line cannot be sent

    @property
    def key(self) -> str:
        """What the output records this line by (``custom_id``, or its line number when it has none usable)."""
        return f"line:{self.number}" if self.keyed_by_line else f"id:{self.custom_id}"

    @property
    def keyed_by_line(self) -> bool:
        return self.custom_id is None or (self.error is not None and self.error[0] == "duplicate_custom_id")


def register(subparsers) -> None:
    parser = subparsers.add_parser("run-batch", help="run an OpenAI batch file (JSONL) offline, resumably",
                                   description="Run the requests of an OpenAI batch input file through the "
                                               "engine and write the results as they finish; rerunning after "
                                               "a crash continues where it stopped.")
    parser.add_argument("-i", "--input-file", required=True, help="the batch input file (JSONL)")
    parser.add_argument("-o", "--output-file", required=True,
                        help="the results (JSONL); lines already there are kept and their requests skipped")
    parser.add_argument("--max-concurrency", type=int, default=256,
                        help="requests in flight at once (default: 256)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    configure_logging("warning")
    settings = ServerSettings(engine=engine_config(**engine_kwargs(args)), engine_mode="thread", log_level="warning")
    summary = asyncio.run(run_batch(settings, Path(args.input_file), Path(args.output_file),
                                    args.max_concurrency, progress=not args.no_progress))
    print(f"podium run-batch: {summary['written']} results written to {args.output_file} "
          f"({summary['skipped']} already there, {summary['errors']} errors)", file=sys.stderr)
    return 0


async def run_batch(settings: ServerSettings, input_path: Path, output_path: Path, max_concurrency: int = 256,
                    progress: bool = True, engine: Any = None) -> dict[str, int]:
    """Run every input line that has no result in ``output_path`` yet; returns counts."""
    import httpx

    from .app import create_app

    done = repair_output(output_path)
    lines = read_input(input_path)
    todo = [line for line in lines if line.key not in done]
    summary = {"written": 0, "skipped": len(lines) - len(todo), "errors": 0}
    if not todo:
        return summary
    app = create_app(settings, engine)
    bar = _NoBar()
    with open(output_path, "ab") as out:
        def write(entry: dict) -> None:
            out.write(json.dumps(entry, ensure_ascii=False).encode() + b"\n")
            out.flush()
            summary["written"] += 1
            summary["errors"] += entry["error"] is not None
            bar.update(1)

        async with app.router.lifespan_context(app):  # loads the model
            bar = _progress(len(lines), summary["skipped"], progress)
            routes = _post_routes(app)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url=BASE_URL, timeout=None) as client:
                pending = iter(todo)  # shared by the workers: each line is taken once

                async def worker() -> None:
                    for line in pending:
                        write(await _result(client, routes, line))

                await asyncio.gather(*(worker() for _ in range(min(max_concurrency, len(todo)))))
    bar.close()
    return summary


def read_input(path: Path) -> list[BatchLine]:
    lines, seen = [], set()
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            line = parse_line(number, text)
            if line.custom_id is not None and line.error is None:
                if line.custom_id in seen:
                    line.error = ("duplicate_custom_id", f"line {number}: custom_id {line.custom_id!r} was "
                                                         f"already used by an earlier line")
                seen.add(line.custom_id)
            lines.append(line)
    return lines


def parse_line(number: int, text: str) -> BatchLine:
    try:
        data = json.loads(text)
    except ValueError as exc:
        return BatchLine(number, None, error=("invalid_json", f"line {number} is not valid JSON: {exc}"))
    if not isinstance(data, dict):
        return BatchLine(number, None, error=("invalid_request", f"line {number} must be a JSON object"))
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchLine(number, None, error=("invalid_request", f"line {number}: custom_id must be a non-empty "
                                                                 f"string"))
    line = BatchLine(number, custom_id, str(data.get("url", "")), data.get("body"))
    if data.get("method", "POST") != "POST":
        line.error = ("invalid_request", f"line {number}: method must be POST, got {data.get('method')!r}")
    elif not isinstance(line.body, dict):
        line.error = ("invalid_request", f"line {number}: body must be a JSON object")
    return line


def repair_output(path: Path) -> set[str]:
    """Cut a half-written last line off ``path`` (a crash mid-write); the keys of the lines kept."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    keys = set()
    for text in data[:end].splitlines():
        try:
            entry = json.loads(text)
        except ValueError:
            raise ValueError(f"{path} has a line that is not JSON in its middle; it is not a run-batch output "
                             f"(or was edited): {text[:80]!r}") from None
        keys.add(f"line:{entry['input_line']}" if "input_line" in entry else f"id:{entry.get('custom_id')}")
    if end != len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    return keys


async def _result(client, routes: set[str], line: BatchLine) -> dict:
    out_id = f"batch_req_{uuid.uuid4().hex}"
    entry = {"id": out_id, "custom_id": line.custom_id, "response": None, "error": None}
    if line.keyed_by_line:
        entry["input_line"] = line.number
    if line.error is None and line.url not in routes:
        line.error = ("unsupported_url", f"line {line.number}: this server has no POST {line.url} endpoint "
                                         f"(it has {', '.join(sorted(routes))})")
    if line.error is not None:
        entry["error"] = {"code": line.error[0], "message": line.error[1]}
        return entry
    body = {k: v for k, v in line.body.items() if k not in ("stream", "stream_options")}  # one answer per line
    response = await client.post(line.url, json=body, headers={"X-Request-Id": out_id})
    try:
        payload = response.json()
    except ValueError:
        payload = {"error": {"message": response.text[:1000], "type": "internal_error"}}
    entry["response"] = {"status_code": response.status_code, "request_id": out_id, "body": payload}
    return entry


def _post_routes(app) -> set[str]:
    return {route.path for route in app.routes
            if route.path.startswith("/v1/") and "POST" in (getattr(route, "methods", None) or ())}


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, initial: int, show: bool):
    if not show:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="run-batch", unit="req", file=sys.stderr)


def iter_results(path: Path) -> Iterator[dict]:
    """The result lines of an output file (for scripts and tests)."""
    with open(path, encoding="utf-8") as f:
        for text in f:
            yield json.loads(text)
