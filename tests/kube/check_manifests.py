#!/usr/bin/env python3
"""tests/kube/check_manifests.py: what deploy/kubernetes promises and a schema
cannot see, checked from the manifests themselves (run by tests/kube/run-tests,
with the venv's PyYAML):
  - the gateway reaches the daemon's socket: the same hostPath directory in both
    pods, the daemon's --listen and the gateway's --socket the same file in it;
  - every workspace root of scriptgate.toml is mounted at its own path from the
    same path on the node in both pods (scriptgate-protocol(7): a path an engine
    sends is opened in the daemon's mount namespace);
  - the ConfigMap and the Secret are mounted file by file (subPath: a Secret
    volume's files are symlinks, which the key's reader refuses) where
    --config and auth.token_key_file say, the key with no permission for others;
  - the gateway pod's runAsGroup and fsGroup are the image's scriptgate group
    (deploy/kubernetes/image/build pins its gid), which allowed_groups names;
  - the daemon's grace period outlasts server.drain_s.
Prints `ok - ...` / `not ok - ...` lines and a `# pass N` / `# fail M` tally."""
import os
import re
import sys
import tomllib

import yaml

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
KUBE = os.path.join(REPO, "deploy", "kubernetes")
results = []


def check(name, cond, detail=""):
    results.append(bool(cond))
    print(("ok - " if cond else "not ok - ") + "kube: " + name)
    if not cond and detail:
        print(f"#   {detail}")


def load(name):
    return yaml.safe_load(open(os.path.join(KUBE, name)))


def arg(cmd, flag):
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def host_path_of(pod, path):
    """The node's path a container path is, through a hostPath mount; None if
    no hostPath mount holds it."""
    vols = {v["name"]: v for v in pod["volumes"]}
    best = None
    for m in pod["containers"][0]["volumeMounts"]:
        mp = m["mountPath"].rstrip("/")
        v = vols[m["name"]]
        if "hostPath" in v and (path == mp or path.startswith(mp + "/")):
            if best is None or len(mp) > len(best[0]):
                best = (mp, v["hostPath"]["path"].rstrip("/") + path[len(mp):])
    return best[1] if best else None


def file_mount(pod, path):
    """The volume and mount that put a single file at `path` (subPath)."""
    vols = {v["name"]: v for v in pod["volumes"]}
    for m in pod["containers"][0]["volumeMounts"]:
        if m["mountPath"] == path:
            return vols[m["name"]], m
    return None, None


def main():
    ds, gw = load("daemonset.yaml"), load("gateway.yaml")
    dpod, gpod = ds["spec"]["template"]["spec"], gw["spec"]["template"]["spec"]
    dcmd, gcmd = dpod["containers"][0]["command"], gpod["containers"][0]["command"]
    cfg = tomllib.load(open(os.path.join(KUBE, "scriptgate.toml"), "rb"))

    listen, socket = arg(dcmd, "--listen"), arg(gcmd, "--socket")
    on_node = host_path_of(dpod, listen or ""), host_path_of(gpod, socket or "")
    check("the gateway's --socket is the file the daemon's --listen binds, through the same hostPath",
          on_node[0] is not None and on_node[0] == on_node[1],
          f"daemon {listen} -> {on_node[0]}, gateway {socket} -> {on_node[1]}")
    for root in cfg["workspace"]["roots"]:
        check(f"workspace root {root}: the same node path at the same path in the daemon's and the gateway's pods",
              host_path_of(dpod, root) == root and host_path_of(gpod, root) == root,
              f"daemon: {host_path_of(dpod, root)}, gateway: {host_path_of(gpod, root)}")
    key = cfg["auth"]["token_key_file"]
    for who, pod, cmd in (("daemon", dpod, dcmd), ("gateway", gpod, gcmd)):
        vol, m = file_mount(pod, arg(cmd, "--config"))
        check(f"{who}: --config is the ConfigMap's scriptgate.toml, mounted as a file",
              vol and vol.get("configMap", {}).get("name") == "scriptgate-config" and m.get("subPath") == "scriptgate.toml")
        vol, m = file_mount(pod, key)
        mode = (vol or {}).get("secret", {}).get("defaultMode", 0o644)
        check(f"{who}: auth.token_key_file is the Secret's token.key, mounted as a file, no permission for others",
              vol and vol.get("secret", {}).get("secretName") == "scriptgate-token-key"
              and m.get("subPath") == "token.key" and mode & 0o007 == 0, f"{vol} {m}")
    build = open(os.path.join(KUBE, "image", "build")).read()
    gid = re.search(r"groupadd --system --gid (\d+) scriptgate$", build, re.M)
    sc = gpod["securityContext"]
    check("the gateway runs as the image's group scriptgate (runAsGroup, fsGroup), which allowed_groups names",
          gid and sc.get("runAsGroup") == int(gid.group(1)) == sc.get("fsGroup")
          and "scriptgate" in cfg["auth"]["allowed_groups"] and sc.get("runAsUser", 0) != 0,
          f"image gid {gid and gid.group(1)}, pod {sc}")
    check("the daemon's pod waits for server.drain_s before it is killed",
          dpod["terminationGracePeriodSeconds"] > cfg["server"]["drain_s"])
    fails = results.count(False)
    print(f"# pass {len(results) - fails}\n# fail {fails}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
