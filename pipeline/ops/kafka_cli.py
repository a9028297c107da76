"""``voicebus kafka fetch|start [--brokers N] [--secure]|env|status|kill N|restart N|stop``: the
command line of the local Kafka (`voicebus.ops.broker`, `voicebus.ops.cluster`)."""

from __future__ import annotations

import sys

from voicebus.ops.broker import BrokerError, fetch_jars
from voicebus.ops.cluster import LocalCluster
from voicebus.ops.kafka_security import ROLES, client_settings_env
from voicebus.settings import Settings



# --- CLI -----------------------------------------------------------------------------------------


def register(subparsers) -> None:
    p = subparsers.add_parser("kafka", help="run a local Apache Kafka (KRaft on loopback, 1 or more nodes, no Docker)")
    sub = p.add_subparsers(dest="kafka_command", metavar="ACTION")
    fetch = sub.add_parser("fetch", help="resolve the Kafka jars from Maven Central (once, cached)")
    fetch.set_defaults(func=_cmd_fetch)
    start = sub.add_parser(
        "start", help="start the broker(s); returns once they answer, printing the bootstrap list",
        description="Start a local Kafka (KRaft, loopback): one node, or --brokers N nodes whose controllers form "
                    "the quorum. Prints the bootstrap list once every node answers. The other voicebus commands "
                    "connect to VOICEBUS_BOOTSTRAP (default 127.0.0.1:9092), which does not follow --port: with "
                    "another port, set VOICEBUS_BOOTSTRAP=127.0.0.1:<port> for them (for a cluster, the printed "
                    "list).")
    start.add_argument("--brokers", type=int, default=1,
                       help="nodes (combined broker + controller, a quorum of all of them); default 1. "
                            "Node i uses the port + 2(i-1) and the controller port + 2(i-1)")
    start.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the nodes")
    start.add_argument("--secure", action="store_true",
                       help="SASL_SSL (SCRAM-SHA-512 over TLS) for clients, mutual TLS between nodes, ACLs "
                            "enforced; a CA, certificates and one user per role (admin, agent, gate, worker, edge) "
                            "are generated once; prints the VOICEBUS_KAFKA_* lines of --role to export")
    start.add_argument("--role", default="admin", choices=ROLES,
                       help="whose VOICEBUS_KAFKA_* lines --secure prints (default admin)")
    env = sub.add_parser("env", help="the VOICEBUS_* lines a role exports to reach the secured local broker "
                                     "(the password as a file, never its value)")
    env.add_argument("--role", default="admin", choices=ROLES)
    status = sub.add_parser("status", help="every node: alive, answering, ports, partitions it leads "
                                           "(exit 0 if all answer)")
    kill = sub.add_parser("kill", help="SIGKILL node N (a crash, for chaos runs)")
    kill.add_argument("node", type=int, help="node id (1 to the number of brokers)")
    restart = sub.add_parser("restart", help="start node N again (stopping it first if it runs)")
    restart.add_argument("node", type=int, help="node id (1 to the number of brokers)")
    restart.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the node")
    stop = sub.add_parser("stop", help="stop every node started by `voicebus kafka start`")
    for parser, func in ((start, _cmd_start), (status, _cmd_status), (kill, _cmd_kill), (restart, _cmd_restart),
                         (stop, _cmd_stop), (env, _cmd_env)):
        parser.add_argument("--port", type=int, metavar="P",
                            help="node 1's client port (default: VOICEBUS_KAFKA_PORT, 9092)")
        parser.add_argument("--controller-port", type=int, metavar="P",
                            help="node 1's KRaft controller port (default: VOICEBUS_KAFKA_CONTROLLER_PORT, 9093)")
        parser.set_defaults(func=func)
    p.set_defaults(func=lambda args, settings: (p.print_help(), 2)[1])


def broker_settings(args, settings: Settings) -> Settings:
    """`--port`/`--controller-port` mapped onto `Settings.kafka_port`/`kafka_controller_port`."""
    changes = {}
    if getattr(args, "port", None) is not None:
        changes["kafka_port"] = args.port
    if getattr(args, "controller_port", None) is not None:
        changes["kafka_controller_port"] = args.controller_port
    return settings.replace(**changes) if changes else settings


def _cmd_fetch(args, settings: Settings) -> int:
    try:
        path = fetch_jars(settings.kafka_dir, settings.kafka_version)
    except BrokerError as exc:
        print(f"voicebus kafka fetch: {exc}", file=sys.stderr)
        return 1
    print(f"Apache Kafka {settings.kafka_version} jars: {path}")
    return 0


def _cmd_start(args, settings: Settings) -> int:
    settings = broker_settings(args, settings)
    try:
        fetch_jars(settings.kafka_dir, settings.kafka_version)
        cluster = LocalCluster.from_settings(settings, brokers=args.brokers, secure=args.secure).start(args.timeout)
    except BrokerError as exc:
        print(f"voicebus kafka start: {exc}", file=sys.stderr)
        return 1
    if cluster.security is not None:
        print(cluster.bootstrap)
        print(f"# SASL_SSL (SCRAM-SHA-512 over TLS) at {cluster.bootstrap}; the settings of {args.role}:")
        _print_exports(cluster, args.role)
        return 0
    configured = {b.strip() for b in settings.bootstrap.split(",")}
    if not configured & {n.bootstrap for n in cluster.nodes}:
        print(f"note: VOICEBUS_BOOTSTRAP is {settings.bootstrap}; the other commands reach this "
              f"{'broker' if len(cluster.nodes) == 1 else 'cluster'} with VOICEBUS_BOOTSTRAP={cluster.bootstrap}",
              file=sys.stderr)
    print(cluster.bootstrap)
    return 0


def _print_exports(cluster: LocalCluster, role: str) -> None:
    for name, value in client_settings_env(cluster.security, role, cluster.bootstrap).items():
        print(f"export {name}={value}")


def _cmd_env(args, settings: Settings) -> int:
    settings = broker_settings(args, settings)
    try:
        cluster = LocalCluster.from_settings(settings, secure=True) if LocalCluster._secure_state_exists(settings) else None
    except BrokerError as exc:
        print(f"voicebus kafka env: {exc}", file=sys.stderr)
        return 1
    if cluster is None:
        print("voicebus kafka env: no secured local broker here (start one with `voicebus kafka start --secure`)",
              file=sys.stderr)
        return 1
    _print_exports(cluster, args.role)
    return 0


def _cmd_status(args, settings: Settings) -> int:
    try:
        status = LocalCluster.from_settings(broker_settings(args, settings)).status()
    except BrokerError as exc:
        print(f"voicebus kafka status: {exc}", file=sys.stderr)
        return 1
    print(status.describe())
    return 0 if status.healthy else 1


def _cmd_kill(args, settings: Settings) -> int:
    try:
        pid = LocalCluster.from_settings(broker_settings(args, settings)).kill(args.node)
    except BrokerError as exc:
        print(f"voicebus kafka kill: {exc}", file=sys.stderr)
        return 1
    print(f"killed node {args.node} (pid {pid})" if pid is not None else f"node {args.node} was not running")
    return 0 if pid is not None else 1


def _cmd_restart(args, settings: Settings) -> int:
    try:
        node = LocalCluster.from_settings(broker_settings(args, settings)).restart(args.node, timeout=args.timeout)
    except BrokerError as exc:
        print(f"voicebus kafka restart: {exc}", file=sys.stderr)
        return 1
    print(node.bootstrap)
    return 0


def _cmd_stop(args, settings: Settings) -> int:
    try:
        cluster = LocalCluster.from_settings(broker_settings(args, settings))
    except BrokerError as exc:
        print(f"voicebus kafka stop: {exc}", file=sys.stderr)
        return 1
    stopped = cluster.stop()
    if not stopped:
        print("not running")
    elif len(cluster.nodes) == 1:
        print("stopped")
    else:
        print(f"stopped {stopped} of {len(cluster.nodes)} nodes")
    return 0
