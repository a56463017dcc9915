"""Extra engine flags may not move a listener of a server this tool starts (issue 40).

Every server the tool starts (``server start``, a suite's managed server, a case's or a fix's restarted copy) binds
127.0.0.1 at the port the tool chose and printed; extra engine flags (``server start ... -- FLAGS``, a params file's
``server.managed.extra_args``, a case's ``launch.extra_args``) are appended after the tool's own, so the engine's
parser would let a later ``--host 0.0.0.0`` win. :func:`refuse_listener_flags` refuses, before anything starts, every
flag of :data:`LISTENER_FLAGS` in them, in every spelling the engine's own parser takes for it:

* ``--host X``, ``--host=X``;
* an abbreviation argparse expands (``--ho X``: both engines' parsers keep argparse's ``allow_abbrev``);
* vLLM's underscore spelling (``--data_parallel_address``: ``vllm/utils/argparse_utils.py::FlexibleArgumentParser.
  parse_args`` turns ``_`` into ``-`` in flag names) and its dotted JSON keys (``--kv-events-config.endpoint X``).

``tests/unit/server/test_listener_flags.py`` parses every refused spelling with SGLang 0.5.23's and vLLM 0.32.0's own
parsers (each lands on a listener setting) and checks that no other flag of either parser is refused.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..errors import BadServerInput, printable

#: per engine: each flag (every option string of its parser) that sets where a listener binds, and what it is
LISTENER_FLAGS: dict[str, dict[str, str]] = {
    "sglang": {
        "--host": "the HTTP server's address (sglang/srt/arg_groups/fields/serving.py::host)",
        "--port": "the HTTP server's port (sglang/srt/arg_groups/fields/serving.py::port)",
        "--dist-init-addr": "torch.distributed's init address, where its TCPStore listens "
                            "(sglang/srt/arg_groups/fields/parallel.py::dist_init_addr)",
        "--nccl-init-addr": "the old name of --dist-init-addr (sglang/srt/arg_groups/fields/parallel.py)",
        "--kv-events-config": "a ZMQ publisher's endpoint, tcp://*:5557 (every interface) by default "
                              "(sglang/srt/disaggregation/kv_events.py::KVEventsConfig.endpoint)",
        "--load-publish-endpoint": "the load publisher's bind address "
                                   "(sglang/srt/disaggregation/kv_events.py, observability.py::load_publish_endpoint)",
        "--decoupled-spec-bind-endpoint": "a ZMQ bind endpoint (sglang/srt/arg_groups/fields/disagg.py)",
        "--disaggregation-mode": "prefill / decode disaggregation, whose KV sockets bind the machine's own address "
                                 "(sglang/srt/disaggregation/common/conn.py: get_local_ip_auto, "
                                 "sglang/srt/utils/network.py)",
        "--config": "a YAML file of flags, --host among them "
                    "(sglang/srt/server_args.py::prepare_server_args, ConfigArgumentMerger)",
    },
    "vllm": {
        "--host": "the HTTP server's address (vllm/entrypoints/launchers/cli_args.py::FrontendArgs.host)",
        "--port": "the HTTP server's port (vllm/entrypoints/launchers/cli_args.py::FrontendArgs.port)",
        "--uds": "a Unix socket instead of host and port (vllm/entrypoints/launchers/cli_args.py::FrontendArgs.uds)",
        "--data-parallel-address": "the data-parallel head's address (vllm/engine/arg_utils.py::EngineArgs."
                                   "data_parallel_address)",
        "-dpa": "short for --data-parallel-address (vllm/engine/arg_utils.py::EngineArgs.add_cli_args)",
        "--master-addr": "torch.distributed's master address (vllm/config/parallel.py::ParallelConfig.master_addr)",
        "--kv-events-config": "a ZMQ publisher's endpoint, tcp://*:5557 (every interface) by default "
                              "(vllm/config/kv_events.py::KVEventsConfig.endpoint)",
        "--kv-transfer-config": "a KV connector, listening at its kv_port and the addresses of its "
                                "kv_connector_extra_config (vllm/config/kv_transfer.py::KVTransferConfig)",
        "--ec-transfer-config": "the encoder-cache connector's address, ec_ip "
                                "(vllm/config/ec_transfer.py::ECTransferConfig)",
        "--config": "a YAML file of flags, --host among them "
                    "(vllm/utils/argparse_utils.py::FlexibleArgumentParser._pull_args_from_config)",
    },
}


def _name(arg: str) -> str:
    """The flag name of one argv word: before ``=`` and (vLLM's JSON keys) before ``.``; ``_`` as ``-``."""
    name = arg.split("=", 1)[0]
    if name.startswith("--"):
        name = "--" + name[2:].split(".", 1)[0].replace("_", "-")
    return name


def listener_flag(arg: str, engine: str) -> Optional[str]:
    """The :data:`LISTENER_FLAGS` flag of ``engine`` that the argv word ``arg`` sets (module docstring: ``--host``,
    ``--host=X``, ``--ho``, ``--master_addr``, ``--kv-events-config.endpoint``), or None (not a flag, another flag).

    Raises:
        KeyError: an engine other than ``sglang`` / ``vllm``."""
    flags = LISTENER_FLAGS[engine]
    if not arg.startswith("-") or arg in ("-", "--"):
        return None
    name = _name(arg)
    if name in flags:
        return name
    if name.startswith("--") and len(name) > 2:          # argparse's abbreviations of a long flag
        hits = [f for f in flags if f.startswith("--") and f.startswith(name)]
        if hits:
            return hits[0]
    return None


def refuse_listener_flags(extra: Sequence[str], engine: str, *, where: str = "the extra engine flags") -> None:
    """Refuse a listener flag (:func:`listener_flag`) among ``extra``, before any server starts.

    Raises:
        BadServerInput: one line naming the word, the flag it sets and why (exit 2)."""
    for arg in extra:
        flag = listener_flag(str(arg), engine)
        if flag is not None:
            hint = " (give the port with the tool's own --port)" if flag == "--port" else ""
            raise BadServerInput(f"{arg!r} among {where} sets {flag}: {LISTENER_FLAGS[engine][flag]}; the servers "
                                 f"this tool starts listen on 127.0.0.1 only, at the port it prints, and extra "
                                 f"{engine} flags may not move them{hint}")


#: the listener flags a relaunch command (``investigate`` / ``ablate --relaunch``) may hold: the tool replaces exactly
#: these words (``--host X``, ``--host=X``; :func:`helpers.server.restart.set_flags`,
#: ``helpers.engines.vllm_server.relaunch_command``) by ``--host 127.0.0.1 --port N``
REPLACED_FLAGS = ("--host", "--port")


def command_engines(argv: Sequence[str]) -> tuple[str, ...]:
    """Whose flags a launch command takes, from its program words (those before its first ``--`` flag): ``("vllm",)``
    for ``vllm serve ...`` / ``python -m vllm.entrypoints.openai.api_server ...``, ``("sglang",)`` for ``python -m
    sglang.launch_server ...`` / ``sglang serve ...``, both when neither or both are named (a wrapper script)."""
    head = []
    for word in argv:
        if str(word).startswith("--"):
            break
        head.append(str(word).rsplit("/", 1)[-1])
    found = tuple(e for e in ("sglang", "vllm") if any(w == e or w.startswith(e + ".") for w in head))
    return found if len(found) == 1 else ("sglang", "vllm")


def refuse_relaunch_listener_flags(argv: Sequence[str], *, where: str = "--relaunch") -> None:
    """Refuse a listener flag (:func:`listener_flag`, every spelling) in a relaunch command other than the exact
    ``--host`` / ``--port`` the tool replaces (:data:`REPLACED_FLAGS`), before anything is measured: ``--ho
    0.0.0.0`` or ``--dist-init-addr 0.0.0.0:5000`` would be kept by the fixed copy beside the tool's ``--host
    127.0.0.1``. The engine's list is the command's (:func:`command_engines`: both lists when it names neither).

    Raises:
        BadServerInput: field ``where``, one line naming the word and the flag it sets (exit 2)."""
    engines = command_engines(argv)
    for arg in list(argv)[1:]:
        arg = printable(str(arg))[:200]
        if arg.split("=", 1)[0] in REPLACED_FLAGS:
            continue
        for engine in engines:
            flag = listener_flag(arg, engine)
            if flag is not None:
                raise BadServerInput(
                    f"{arg!r} in the launch command sets {flag}: {LISTENER_FLAGS[engine][flag]}; the fixed copy the "
                    f"tool starts listens on 127.0.0.1 only, at the port it picks: it replaces the command's exact "
                    f"--host / --port and keeps every other word, so leave {arg!r} out", field=where)


__all__ = ["LISTENER_FLAGS", "REPLACED_FLAGS", "command_engines", "listener_flag", "refuse_listener_flags",
           "refuse_relaunch_listener_flags"]
