"""python3 -m detour: a small command line over detour.Client.

    python3 -m detour [--coordinator HOST:PORT] [--tls_ca CA] [--tls_cert C --tls_key K]
                      [--insecure] [--token_file F] [--json] [--reconnect_for S] COMMAND ...

Commands: submit SPEC.json [--watch], get JOB_ID, list [--state S] [--owner NAME],
watch JOB_ID, cancel JOB_ID, resume JOB_ID [--checkpoint DIR] [--replicas_per_stage N],
events JOB_ID [--follow], workers [--all]. The flags and the exit status
follow detourctl's: 0 success, 1 the coordinator refused (or a watched job
did not succeed), 2 bad usage or settings, 3 coordinator unreachable.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from typing import Any, List, Optional

from google.protobuf import json_format

from detour.client import Client
from detour.errors import (ConfigError, DeadlineExceeded, DetourError, InvalidSpec,
                           Unavailable)
from detour.jobs import Job, JobEvent

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


class _Parser(argparse.ArgumentParser):
    """argparse with a suggestion for a mistyped command or choice, as detourctl."""

    def error(self, message: str) -> Any:
        # The value is quoted (repr) in every argparse; the choices are taken
        # from the parser itself, not from the message, whose format changed.
        m = re.search(r"invalid choice: (['\"])(.*?)\1", message)
        if m and "meant" not in message:
            choices = [str(c) for a in self._actions if a.choices for c in a.choices]
            near = difflib.get_close_matches(m.group(2), choices, n=1, cutoff=0.6)
            if near:
                message += " (did you mean %s?)" % near[0]
        super().error(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python3 -m detour",
                                description="Command-line client for the detour coordinator.")
    p.add_argument("--coordinator", help="host:port (default $DETOUR_COORDINATOR, "
                                         "else 127.0.0.1:7070)")
    p.add_argument("--tls_ca", help="PEM CA the coordinator's certificate must chain to")
    p.add_argument("--tls_cert", help="PEM client certificate (with --tls_key)")
    p.add_argument("--tls_key", help="PEM key of --tls_cert")
    p.add_argument("--insecure", action="store_true", help="plaintext")
    p.add_argument("--token_file", help="file holding the bearer token (default $DETOUR_TOKEN)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="print the proto3 JSON mapping")
    p.add_argument("--reconnect_for", type=float, default=300.0,
                   help="seconds a broken watch (events --follow) keeps reconnecting (0: never)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("submit", help="submit a JSON job spec")
    s.add_argument("spec")
    s.add_argument("--watch", action="store_true", help="follow the job until it ends")
    for name, text in (("get", "show one job"), ("watch", "follow a job until it ends"),
                       ("cancel", "cancel a job that has not ended")):
        sub.add_parser(name, help=text).add_argument("job_id")
    s = sub.add_parser("resume", help="restart a failed or cancelled job from a checkpoint")
    s.add_argument("job_id")
    s.add_argument("--checkpoint", default="")
    s.add_argument("--replicas_per_stage", type=int, default=0,
                   help="replicas per stage of the resumed job (default 0: the job's own)")
    s = sub.add_parser("list", help="list jobs, newest first")
    s.add_argument("--state", help="pending, assigning, running, succeeded, failed, cancelled")
    s.add_argument("--owner", help="only the jobs of this owner (a token's name or a CN)")
    s = sub.add_parser("events", help="a job's elastic-training history")
    s.add_argument("job_id")
    s.add_argument("--follow", action="store_true")
    s = sub.add_parser("workers", help="list registered workers")
    s.add_argument("--all", action="store_true", help="include lost workers")
    return p


def _json(message: Any) -> str:
    return str(json_format.MessageToJson(message, preserving_proto_field_name=True, indent=None))


def _line(job: Job) -> str:
    p = job.progress
    text = "%s %s  %d/%d" % (job.id, job.state, p.iteration, p.total_iterations)
    if p.loss > 0:
        text += "  loss %.4f" % p.loss
    if p.tokens_per_s > 0:
        text += "  %.0f tok/s" % p.tokens_per_s
    if job.message and not job.ended:
        text += "  (%s)" % job.message
    return text


def _watch(client: Client, job_id: str, as_json: bool, reconnect_for: float) -> int:
    last: Optional[JobEvent] = None
    for last in client.watch(job_id, reconnect_for=reconnect_for):
        print(_json(last.job.proto) if as_json else _line(last.job), flush=True)
    assert last is not None
    if not as_json:
        print("%s ended: %s — %s" % (last.job.id, last.state, last.job.message))
    return EXIT_OK if last.job.succeeded else EXIT_ERROR


def run(args: argparse.Namespace) -> int:
    if not args.insecure and not (args.tls_ca or args.tls_cert or args.tls_key):
        # As detourctl: the trust is chosen explicitly (the library falls back
        # to the system's roots).
        raise ConfigError("give --tls_ca (the cluster CA) for TLS, or --insecure for plaintext")
    client = Client(args.coordinator, ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key,
                    token_file=args.token_file, insecure=args.insecure, timeout=args.timeout)
    with client:
        if args.command == "submit":
            job_id = client.submit(args.spec)
            if not args.json:
                print("submitted %s" % job_id)
            return (_watch(client, job_id, args.json, args.reconnect_for) if args.watch else
                    EXIT_OK)
        if args.command == "get":
            job = client.get(args.job_id)
            if args.json:
                print(_json(job.proto))
            else:
                print(_line(job))
                for i, nodes in enumerate(job.stages):
                    print("  stage %d: %s" % (i, ", ".join(nodes)))
            return EXIT_OK
        if args.command == "list":
            for job in client.list(args.state, owner=args.owner):
                print(_json(job.proto) if args.json else
                      "%-12s %-24s %s" % (job.id, job.name, _line(job)[len(job.id) + 1:]))
            return EXIT_OK
        if args.command == "watch":
            return _watch(client, args.job_id, args.json, args.reconnect_for)
        if args.command in ("cancel", "resume"):
            job = (client.cancel(args.job_id) if args.command == "cancel" else
                   client.resume(args.job_id, args.checkpoint,
                                 replicas_per_stage=args.replicas_per_stage))
            print(_json(job.proto) if args.json else "%s: %s" % (job.id, job.state))
            return EXIT_OK
        if args.command == "events":
            for e in client.events(args.job_id, follow=args.follow,
                                   reconnect_for=args.reconnect_for):
                if args.json:
                    print(json.dumps({"time": e.time.isoformat() if e.time else None,
                                      "kind": e.kind, "iteration": e.iteration,
                                      "worker": e.worker, "message": e.message}), flush=True)
                else:
                    when = e.time.strftime("%H:%M:%S") if e.time else "-"
                    print("%s  it %-5d %-22s %s" % (when, e.iteration, e.kind, e.message),
                          flush=True)
            return EXIT_OK
        if args.command == "workers":
            for w in client.workers(include_lost=args.all):
                print(_json(w.proto) if args.json else "%-10s %-5s %-10s %-22s %s" % (
                    w.worker_id, w.state, w.region, w.address, w.job_id or "-"))
            return EXIT_OK
    raise AssertionError(args.command)


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except (ConfigError, OSError, ValueError) as e:
        print("python3 -m detour: %s: %s" % (args.command, e), file=sys.stderr)
        return EXIT_USAGE
    except (Unavailable, DeadlineExceeded) as e:
        print("python3 -m detour: coordinator unreachable: %s" % e, file=sys.stderr)
        return EXIT_UNREACHABLE
    except (InvalidSpec, DetourError) as e:
        print("python3 -m detour: %s" % e, file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
