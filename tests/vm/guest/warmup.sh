# tests/vm: the job of build-image's warm-up boot (run with --persist: its writes
# stay in the image). The boot itself compiles the AppArmor policy cache and runs
# the first-boot one-offs (ldconfig, catalog, /etc/.updated), so later boots under
# -snapshot start warm. This job then checks what the tests rely on and exits
# non-zero, failing the build, if any of it is missing. "fact k=v" lines go into
# the image's stamp file.
fail=0
bad() { echo "FAIL: $*"; fail=1; }
fs=$(stat -fc %T /sys/fs/cgroup)
aa=$(cat /sys/module/apparmor/parameters/enabled 2>/dev/null || echo absent)
echo "fact debian=$(cat /etc/debian_version)"
echo "fact kernel=$(uname -r)"
echo "fact systemd=$(systemctl --version | sed -n '1s/^systemd //p')"
echo "fact bwrap=$(bwrap --version | awk '{print $2}')"
echo "fact python3=$(python3 --version | awk '{print $2}')"
echo "fact apparmor_parser=$(apparmor_parser --version | sed -n '1s/.* version //p')"
echo "fact cgroup_fs=$fs"
echo "fact cgroup_controllers=$(cat /sys/fs/cgroup/cgroup.controllers 2>/dev/null | tr ' ' ,)"
echo "fact apparmor_enabled=$aa"
echo "fact apparmor_profiles=$(grep -c . /sys/kernel/security/apparmor/profiles 2>/dev/null)"
echo "fact cmdline=$(cat /proc/cmdline)"
[ "$fs" = cgroup2fs ] || bad "/sys/fs/cgroup is $fs, not cgroup2fs: the guest is not on the unified cgroup v2 hierarchy"
[ "$aa" = Y ] || bad "/sys/module/apparmor/parameters/enabled is $aa, not Y: AppArmor is not enabled (kernel command line: $(cat /proc/cmdline))"
aa-status --enabled || bad "aa-status --enabled: AppArmor is not usable"
systemctl is-active --quiet apparmor.service || bad "apparmor.service is $(systemctl is-active apparmor.service)"
cache=$(find /var/cache/apparmor -type f 2>/dev/null | wc -l)
echo "fact apparmor_cache_files=$cache"
[ "$cache" -gt 0 ] || bad "no compiled AppArmor policy in /var/cache/apparmor"
[ "$(id -u tester 2>/dev/null)" = 1000 ] || bad "no user tester with uid 1000"
[ "$(cat /proc/1/comm)" = systemd ] || bad "PID 1 is $(cat /proc/1/comm), not systemd"
grep -rqs '^[^#[:space:]]' /etc/apt/sources.list /etc/apt/sources.list.d/ && bad "APT has sources configured, but the guest has no network"
for p in libc6 libgcc-s1 bubblewrap python3 init-system-helpers systemd apparmor sqlite3; do
    dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null | grep -q '^ii' || bad "package $p is not installed"
done
# The scriptgate .deb's Depends/Recommends (build-image puts them in $deb_fields):
# a .deb with them must install with no download (the guest has no network).
if [ -n "${deb_fields:-}" ]; then
    d=$(mktemp -d); mkdir -p "$d/p/DEBIAN"
    printf 'Package: vmrig-offline-check\nVersion: 1\nArchitecture: all\nMaintainer: tests/vm <root@localhost>\n%s\nDescription: tests/vm: apt install ./x.deb works offline\n' \
        "$deb_fields" > "$d/p/DEBIAN/control"
    dpkg-deb -b "$d/p" "$d/check.deb" >/dev/null
    if out=$(apt-get install -s "$d/check.deb" 2>&1); then
        extra=$(printf '%s\n' "$out" | grep '^Inst ' | grep -v '^Inst vmrig-offline-check ')
        [ -z "$extra" ] || bad "the .deb's dependencies want packages the image lacks: $extra"
        echo "fact deb_deps_offline=$( [ -z "$extra" ] && echo ok || echo missing)"
    else
        bad "apt-get install -s ./x.deb (the .deb's Depends/Recommends) fails offline:"
        printf '%s\n' "$out" | tail -n 8
    fi
    rm -rf "$d"
fi
failed=$(systemctl --failed --no-legend --plain | awk '{print $1}' | tr '\n' ' ')
echo "fact failed_units=${failed:-none}"
echo "AppArmor cache:"; ls /var/cache/apparmor/
exit $fail
