# tests/vm/jobs/fleet.sh: sourced by package.sh in the Debian 13 guest, with the
# package installed (its helpers: check, ok, bad, skip, section, jget, $fleet).
#
# Issue 36's proof, a three-node fleet with one audit trail: three nodes, each a
# systemd-nspawn container booting its own systemd from the guest's tree (a
# tmpfs overlay over it; its own host name, machine id, journal, empty
# /var/lib/scriptgate, and its own scriptgated on its own socket), all sending
# their journals with systemd-journal-upload to one systemd-journal-remote in
# the guest (the central host). The engine in the guest (`scriptgate run
# --socket`: the engine of the example gateway's `scriptgate mcp --socket`)
# starts scripts on all three, with each workspace at the same path on the
# engine's side and the node's (protocol(7), "Workspaces"); one node is killed
# with SIGKILL while two of its scripts run. The central trail must then hold one start per script started,
# one end per script that ended, the killed node's two as lost, nothing twice.
# Figures: scripts per second across the three, and the central trail's lag.

fleet_dir=/srv/fleet
fleet_nodes=(node1 node2 node3)
fleet_port=19532
# The MESSAGE_IDs of "script started" and "script finished" (scriptgated(8)).
fleet_started=2b0a0799d99540589c9c0d06c5c5dd49
fleet_finished=346f6012b1654d13bd185a7cfc0553cb
# A short script (one tool call) and one that runs until its node dies.
fleet_short=$fleet_dir/short.py
fleet_long=$fleet_dir/long.py

# The pid of a node's init, as the guest sees it.
fleet_leader() { machinectl show "$1" -p Leader --value; }
# The node's socket, as the guest sees it: under its leader's root.
fleet_sock() { echo "/proc/$(fleet_leader "$1")/root/run/scriptgate/scriptgate.sock"; }
# fleet_run NODE NAME SCRIPT [ARGS]: the engine runs SCRIPT on NODE; its result
# in $fleet_dir/out/NAME.json.
fleet_run() {
  local node=$1 name=$2 script=$3
  shift 3
  timeout -k 10 300 scriptgate run --json --config "$fleet_dir/scriptgate.toml" --socket "$(fleet_sock "$node")" \
    --mcp "$fleet" "$@" "$script" >"$fleet_dir/out/$name.json" 2>"$fleet_dir/out/$name.err" </dev/null
}
# The central trail, as JSON, with extra arguments.
fleet_trail() { scriptgate audit --journal --directory "$fleet_dir/central" --json --limit 1000 "$@"; }
# fleet_eval EXPR [ARGS]: a Python expression over the central trail `t`.
fleet_eval() {
  local expr=$1
  shift
  fleet_trail "$@" | python3 -c "import json,sys; t=json.load(sys.stdin); print($expr)"
}

# fleet_until WANT EXPR [ARGS]: until fleet_eval EXPR [ARGS] prints WANT, up to
# 120 s (each read of the trail takes a while under TCG); false if it never did.
fleet_until() {
  local want=$1 deadline=$((SECONDS + 120))
  shift
  while [ "$SECONDS" -lt "$deadline" ]; do
    [ "$(fleet_eval "$@")" = "$want" ] && return
    sleep 0.1
  done
  return 1
}

# fleet_is WANT GOT [MORE]: GOT is WANT, or both are shown (and MORE).
fleet_is() {
  [ "$1" = "$2" ] && return
  printf 'want: %s\ngot:  %s\n' "$1" "$2"
  [ $# -gt 2 ] && printf '%s\n' "${@:3}"
  return 1
}

fleet_main() {
  section "a three-node fleet (systemd-nspawn nodes, journal-upload to one journal-remote): issue 36, part 3"
  if ! command -v systemd-nspawn >/dev/null || [ ! -x /usr/lib/systemd/systemd-journal-remote ]; then
    skip "a three-node fleet" "no systemd-nspawn or systemd-journal-remote in this guest (tests/vm/build-image installs them in Debian 13's)"
    return
  fi
  mkdir -p "$fleet_dir"/{base,ws,central,out}
  chmod 0755 "$fleet_dir" "$fleet_dir/ws"
  # The nodes' tree: the guest's root file system alone (no /proc, /run, /srv
  # mounts under it), read-only under each node's tmpfs overlay.
  if ! mount --bind / "$fleet_dir/base" || ! mount -o remount,bind,ro "$fleet_dir/base"; then
    bad "fleet: the guest's root, bound read-only for the nodes" "$(findmnt "$fleet_dir/base" 2>&1)"
    return
  fi
  # The nodes' configuration: the package's engine key and groups, workspaces
  # under the path shared by the engine and the nodes.
  printf '[auth]\ntoken_key_file = "/etc/scriptgate/token.key"\nallowed_groups = ["scriptgate"]\nadmin_groups = ["scriptgate-admin"]\n\n[workspace]\nroots = ["%s/ws"]\n' \
    "$fleet_dir" >"$fleet_dir/scriptgate.toml"
  # The unit's ProtectSystem=strict leaves a workspace root outside its state
  # directory read-only until a drop-in names it (as systemd/scriptgate.service says).
  mkdir -p "$fleet_dir/scriptgate.service.d"
  printf '[Service]\nReadWritePaths=%s/ws\n' "$fleet_dir" >"$fleet_dir/scriptgate.service.d/fleet.conf"
  printf 'import agent_tools\nagent_tools.call("fleet__list_devices", {})\nprint("listed")\n' >"$fleet_short"
  printf 'import time\nprint("up", flush=True)\ntime.sleep(600)\n' >"$fleet_long"

  # The central host: journal-remote in the guest, over plain HTTP on the
  # loopback (the nodes share the guest's network; deploy/fleet-trail has the
  # HTTPS set-up of production).
  systemctl stop sg-central 2>/dev/null
  check "fleet: systemd-journal-remote listens (the central host)" \
    systemd-run --unit=sg-central -p Type=notify /usr/lib/systemd/systemd-journal-remote \
    --listen-http=127.0.0.1:$fleet_port --output="$fleet_dir/central/" --split-mode=host

  local n t0 booted=0
  t0=$(date +%s.%N)
  for n in "${fleet_nodes[@]}"; do
    local d=$fleet_dir/$n
    mkdir -p "$d/state"
    echo "$n" >"$d/hostname"
    systemd-id128 new >"$d/machine-id"
    printf '[Upload]\nURL=http://127.0.0.1:%s\n' "$fleet_port" >"$d/journal-upload.conf"
    # nspawn's image lock is per tree; the three share one, read-only (the
    # units masked write to it, hold the guest's ports or its devices; the
    # job's never runs). Its API file systems (/proc/sys, /sys) are writable:
    # bwrap's --disable-userns writes in /proc/sys in the sandbox's user
    # namespace, as a node's host lets it. Each boots before the next starts
    # (Type=notify: systemd-run returns when the node is up).
    systemd-run --unit="sg-$n" -p Type=notify -p Delegate=yes -p KillMode=mixed \
      --setenv=SYSTEMD_NSPAWN_LOCK=0 --setenv=SYSTEMD_NSPAWN_API_VFS_WRITABLE=1 \
      systemd-nspawn --quiet --boot --machine="$n" --directory="$fleet_dir/base" --volatile=overlay \
      --keep-unit --notify-ready=yes --link-journal=no \
      --bind="$fleet_dir/ws" --bind="$d/state:/var/lib/scriptgate" \
      --bind-ro="$d/hostname:/etc/hostname" --bind-ro="$d/machine-id:/etc/machine-id" \
      --bind-ro="$fleet_dir/scriptgate.toml:/etc/scriptgate/scriptgate.toml" \
      --bind-ro="$d/journal-upload.conf:/etc/systemd/journal-upload.conf" \
      --bind-ro="$fleet_dir/scriptgate.service.d:/etc/systemd/system/scriptgate.service.d" \
      --bind-ro=/dev/null:/etc/systemd/system/vmrig-job.service \
      --bind-ro=/dev/null:/etc/systemd/system/systemd-remount-fs.service \
      --bind-ro=/dev/null:/etc/systemd/system/systemd-machine-id-commit.service \
      --bind-ro=/dev/null:/etc/systemd/system/prometheus-node-exporter.service \
      --bind-ro=/dev/null:/etc/systemd/system/systemd-udevd.service \
      --bind-ro=/dev/null:/etc/systemd/system/systemd-udevd-control.socket \
      --bind-ro=/dev/null:/etc/systemd/system/systemd-udevd-kernel.socket \
      --bind-ro=/dev/null:/etc/systemd/system/systemd-udev-trigger.service \
      >/dev/null 2>"$d/nspawn.err" || true
  done
  for n in "${fleet_nodes[@]}"; do
    local st
    st=$(timeout 180 systemctl -M "$n" is-system-running --wait 2>&1)
    if [ "$st" = running ] || [ "$st" = degraded ]; then
      booted=$((booted + 1))
    else
      bad "fleet: $n booted" "is-system-running: $st" "$(cat "$fleet_dir/$n/nspawn.err")" "$(journalctl -u "sg-$n" -n 40 --no-pager)"
    fi
  done
  python3 -c "import time; print(f'figure fleet_boot_3_nodes_s {time.time() - $t0:.1f}')"
  if [ "$booted" != 3 ]; then
    bad "fleet: three nodes boot their own systemd" "$booted of 3 booted"
    fleet_cleanup
    return
  fi
  ok "fleet: three nodes boot their own systemd (systemd-nspawn, one after another)"
  check "fleet: each node has its own host name and machine id" \
    fleet_is "node1 node2 node3 3" \
    "$(for n in "${fleet_nodes[@]}"; do cat "/proc/$(fleet_leader "$n")/root/etc/hostname"; done | xargs) $(for n in "${fleet_nodes[@]}"; do cat "/proc/$(fleet_leader "$n")/root/etc/machine-id"; done | sort -u | wc -l)"
  # nspawn binds a FIFO over /proc/kmsg and a boot id of the container's own
  # over /proc/sys/kernel/random/boot_id. A /proc with mounts over parts of it
  # is one the kernel refuses to give the sandbox's user namespace (a node of
  # a fleet has no such mounts; the diagnosis names them, "mounts over
  # /proc/kmsg, /proc/sys/kernel/random/boot_id"): they are unmounted before
  # the node's daemon starts (socket-activated, at the first script).
  local unmasked=0
  for n in "${fleet_nodes[@]}"; do
    nsenter -t "$(fleet_leader "$n")" -m -p umount /proc/kmsg /proc/sys/kernel/random/boot_id &&
      unmasked=$((unmasked + 1))
    systemctl -M "$n" list-units --failed --no-legend --plain 2>&1 | sed "s/^/# $n failed unit: /"
    systemctl -M "$n" start systemd-journal-upload.service 2>&1 | sed "s/^/# $n: /"
  done
  check "fleet: the nodes' /proc is a host's (nspawn's two mounts over it undone)" test "$unmasked" = 3
  # A forged start in node1's journal, by a user other than root: uploaded with
  # the rest, counted by nobody (the trail and the OTel query take uid 0's; its
  # priority is info, so that only its uid leaves it out of the query).
  check "fleet: a user other than root writes a forged start entry on node1" \
    systemd-run -M node1 --wait -q -p User=nobody /bin/sh -c \
    "printf 'MESSAGE_ID=$fleet_started\nMESSAGE=script forged started\nSCRIPTGATE_SCRIPT_ID=f0f0f0f0f0f0f0f0\nSCRIPTGATE_TIMEOUT_S=60\nPRIORITY=6\n' | logger --journald"
  local socks=()
  for n in "${fleet_nodes[@]}"; do socks+=("$(fleet_sock "$n")"); done
  check "fleet: each node's socket is its own (socket-activated in the node)" \
    bash -c 'for s in "$@"; do test -S "$s" || { echo "no socket at $s"; exit 1; }; done; [ "$(stat -L -c %d:%i "$@" | sort -u | wc -l)" = 3 ] || { stat -L "$@"; exit 1; }' _ "${socks[@]}"

  # Scripts on all three: three engines' streams per node, three scripts each,
  # together (a node runs 4 at a time: scripts.max_concurrency).
  local per=3 streams=3 s i start end total=0
  local pids=()
  start=$(date +%s%N)
  for n in "${fleet_nodes[@]}"; do
    for s in $(seq "$streams"); do
      (for i in $(seq "$per"); do fleet_run "$n" "$n-$s-$i" "$fleet_short"; done) &
      pids+=($!)
    done
  done
  wait "${pids[@]}"
  end=$(date +%s%N)
  local want=$((${#fleet_nodes[@]} * streams * per))
  # The central trail's lag: from the last engine's exit to all of their
  # entries in journal-remote's output (uploaded as they are written), polled
  # before anything else reads.
  if fleet_until "$want" "t['states'].get('ended', 0)"; then
    local lag=$((($(date +%s%N) - end) / 1000000))
    ok "fleet: the central trail has every script's start and end"
    echo "figure fleet_central_trail_lag_ms $lag (the last engine's exit to every end entry read from journal-remote's output; polled every 0.1 s, each read included)"
  else
    bad "fleet: the central trail has every script's start and end" "$(fleet_trail | head -c 3000)"
  fi
  local okc=0 badc=() f
  for f in "$fleet_dir"/out/node*-*-*.json; do
    total=$((total + 1))
    if [ "$(jget "$f" status)" = ok ]; then okc=$((okc + 1)); else badc+=("$(basename "$f"): $(jget "$f" status) $(jget "$f" error) $(tail -n 1 "${f%.json}.err")"); fi
  done
  if [ "$okc" = "$want" ]; then
    ok "fleet: $want scripts through the engine on all three nodes, all ok"
  else
    bad "fleet: $want scripts through the engine on all three nodes, all ok" "$okc of $total ok" "${badc[@]:0:3}" \
      "$(journalctl -M node1 -u scriptgate.service -n 15 --no-pager 2>&1)"
  fi
  python3 -c "import sys; n,ms=int(sys.argv[1]),(int(sys.argv[3])-int(sys.argv[2]))/1e6; print(f'figure fleet_scripts_per_s {n/(ms/1000):.2f} ({n} scripts, 9 engines on 3 nodes, {ms/1000:.1f} s)')" "$want" "$start" "$end"

  check "fleet: the central trail has the scripts by host, each node's own, nothing twice" \
    fleet_is "{'node1': 9, 'node2': 9, 'node3': 9} 0 {'ok': 27}" \
    "$(fleet_eval "dict(sorted(t['hosts'].items())), t['duplicates'], t['statuses']")"
  check "fleet: the central trail's script ids are the results' (one start and one end each)" \
    fleet_is "$(for f in "$fleet_dir"/out/node*-*-*.json; do jget "$f" script_id; done | sort)" \
    "$(fleet_eval "'\\n'.join(sorted(s['script_id'] for s in t['scripts'] if s['state'] == 'ended'))")"

  # node3 killed with SIGKILL while two of its scripts run (each up, its
  # start entry at the central host first: what the node never sent cannot
  # be counted).
  fleet_run node3 lost-1 "$fleet_long" --timeout 300 &
  local l1=$!
  fleet_run node3 lost-2 "$fleet_long" --timeout 300 &
  local l2=$!
  if fleet_until 2 "t['states'].get('running', 0)" --host node3; then ok "fleet: node3's two long scripts are running in the central trail"; else bad "fleet: node3's two long scripts are running in the central trail" "$(fleet_trail --host node3 | head -c 2000)" "$(cat "$fleet_dir"/out/lost-*.err)"; fi
  check "fleet: node3 killed with SIGKILL (every process of the machine)" machinectl kill --signal=SIGKILL node3
  timeout 60 bash -c 'while machinectl show node3 >/dev/null 2>&1; do sleep 0.2; done'
  local r1 r2
  wait "$l1"; r1=$?
  wait "$l2"; r2=$?
  check "fleet: the engine of each killed script is told its daemon went away (exit 7, interrupted)" \
    fleet_is "7 7 2" "$r1 $r2 $(cat "$fleet_dir"/out/lost-*.err | grep -c 'went away while script .* was running')" \
    "$(tail -n 3 "$fleet_dir"/out/lost-*.err)"
  check "fleet: node1 and node2 still run scripts" fleet_after
  fleet_until 29 "t['states'].get('ended', 0)"
  # Past the lost scripts' timeout (300 s) and the grace (120 s).
  check "fleet: the central trail: 31 started, 29 ended, node3's 2 lost, nothing twice" \
    fleet_is "31 {'ended': 29, 'lost': 2} 0 {'node1': 10, 'node2': 10, 'node3': 11}" \
    "$(fleet_eval "t['matched'], t['states'], t['duplicates'], dict(sorted(t['hosts'].items()))" --as-of +10m)"
  check "fleet: the lost ones are node3's two, listed by scriptgate audit --journal --lost" \
    fleet_is "[('node3', 'lost'), ('node3', 'lost')]" "$(fleet_eval "sorted((s['host'], s['state']) for s in t['scripts'])" --as-of +10m --lost)"
  # deploy/fleet-trail/otelcol.yaml's journald receiver: the journalctl query
  # it runs (its matches, as the receiver joins them) over the central journal.
  local otel=/usr/share/doc/scriptgate/examples/fleet-trail/otelcol.yaml query
  query=$(python3 - "$otel" <<'EOF'
import re, sys
groups, inside = [], False
for line in open(sys.argv[1]):
    if re.match(r"\s+matches:\s*$", line):
        inside = True
        continue
    if inside:
        m = re.match(r'\s+(- )?([A-Z_]+):\s*"?([^"#\s]+)"?', line)
        if m is None:
            inside = inside and not line.strip()
            continue
        if m.group(1):
            groups.append([])
        groups[-1].append(f"{m.group(2)}={m.group(3)}")
print(" + ".join(" ".join(g) for g in groups))
EOF
  )
  # shellcheck disable=SC2086 # the matches are words, `+` among them
  check "fleet: the OTel Collector's journald query (deploy/fleet-trail/otelcol.yaml) takes 31 starts and 29 ends, not the forged one" \
    fleet_is "60 61" "$(journalctl --utc --output=json --no-pager --priority info --directory "$fleet_dir/central" $query | wc -l) $(journalctl --output=json --no-pager --directory "$fleet_dir/central" MESSAGE_ID=$fleet_started + MESSAGE_ID=$fleet_finished | wc -l)" \
    "query: $query"
  local table
  table=$(scriptgate audit --journal --directory "$fleet_dir/central" --as-of +10m 2>&1)
  check "fleet: the people's table says it" says "31 scripts on 3 hosts: 29 ended .*2 lost" "$table"
  fleet_cleanup
}

fleet_after() { fleet_run node1 after-1 "$fleet_short" && fleet_run node2 after-2 "$fleet_short"; }

fleet_cleanup() {
  local n
  for n in "${fleet_nodes[@]}"; do
    systemctl kill --signal=SIGKILL "sg-$n" 2>/dev/null
    systemctl stop "sg-$n" 2>/dev/null
    systemctl reset-failed "sg-$n" 2>/dev/null
  done
  systemctl stop sg-central 2>/dev/null
  umount "$fleet_dir/base" 2>/dev/null
}

fleet_main
