#!/usr/bin/env python3
"""List, then watch, ConfigMaps with the official Kubernetes Python client.

    list_watch.py KUBECONFIG NAMESPACE N [TIMEOUT_SECONDS]

Prints, one line each, flushed at once:

    LIST <resourceVersion> <count>      the list's metadata.resourceVersion and item count
    NAME <name>                          each listed ConfigMap, in the order the server returned
    EVENT <type> <name> <resourceVersion>   each watch event, watching from the list's RV
    DONE <events>                        after N events (exit 0)

The watch uses timeoutSeconds=TIMEOUT_SECONDS (default 30). Exit status: 0 after N events,
1 when the watch ended before N events, 2 on bad usage, 3 when the server sent an ERROR event
or failed a request (e.g. 410 Expired), with `ERROR <code> <reason>` on stdout.
"""

import sys

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException


def out(*fields):
    print(*fields, flush=True)


def main(argv):
    if len(argv) not in (4, 5):
        print(__doc__, file=sys.stderr)
        return 2
    kubeconfig, namespace, n = argv[1], argv[2], int(argv[3])
    timeout = int(argv[4]) if len(argv) == 5 else 30

    api = client.CoreV1Api(config.new_client_from_config(config_file=kubeconfig))
    try:
        listed = api.list_namespaced_config_map(namespace)
        rv = listed.metadata.resource_version
        out("LIST", rv, len(listed.items))
        for cm in listed.items:
            out("NAME", cm.metadata.name)

        seen = 0
        if n > 0:
            w = watch.Watch()
            for event in w.stream(
                api.list_namespaced_config_map,
                namespace,
                resource_version=rv,
                timeout_seconds=timeout,
            ):
                obj = event["object"]
                out("EVENT", event["type"], obj.metadata.name, obj.metadata.resource_version)
                seen += 1
                if seen >= n:
                    w.stop()
                    break
    except ApiException as e:
        out("ERROR", e.status, e.reason)
        print(f"list_watch.py: {e}", file=sys.stderr)
        return 3
    if seen < n:
        print(f"list_watch.py: watch ended after {seen} of {n} events", file=sys.stderr)
        return 1
    out("DONE", seen)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
