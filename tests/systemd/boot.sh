#!/bin/bash
# PID 1 of the test rig: a real systemd in a private PID/mount/UTS/IPC namespace,
# kept from host-global state. Started by the rig in tests/common/boot.rs.
# Private /run, /tmp and /var/tmp; the units that would touch the host (tmpfiles
# cleaning /tmp, sysctls, modules, clock, udev, ...) are masked in the private /run.
set -e
# A checkout under /tmp would vanish under the private /tmp: bind it aside and back.
keep="${SCRIPTGATE_RIG_KEEP:-}"
if [ -n "$keep" ]; then mkdir -p /run/.keep-src; fi
mount -t tmpfs tmpfs /run
mkdir -p /run/lock /run/systemd/system
if [ -n "$keep" ] && [ "${keep#/tmp/}" != "$keep" ]; then
  mkdir -p /run/.keep && mount --bind "$keep" /run/.keep
fi
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /var/tmp
if [ -n "$keep" ] && [ "${keep#/tmp/}" != "$keep" ]; then
  mkdir -p "$keep" && mount --bind /run/.keep "$keep"
fi
for u in systemd-tmpfiles-setup.service systemd-tmpfiles-setup-dev.service \
  systemd-tmpfiles-setup-dev-early.service systemd-tmpfiles-clean.timer \
  systemd-sysctl.service systemd-modules-load.service systemd-timesyncd.service \
  systemd-binfmt.service systemd-random-seed.service systemd-remount-fs.service \
  systemd-sysusers.service systemd-firstboot.service systemd-machine-id-commit.service \
  systemd-udevd.service systemd-udev-trigger.service systemd-udevd-control.socket \
  systemd-udevd-kernel.socket systemd-journal-flush.service systemd-update-utmp.service \
  systemd-hwdb-update.service kmod-static-nodes.service ldconfig.service tmp.mount \
  cron.service apt-daily.timer apt-daily-upgrade.timer man-db.timer logrotate.timer \
  e2scrub_all.timer fstrim.timer dpkg-db-backup.timer; do
  ln -s /dev/null /run/systemd/system/$u
done
export container=other
# basic.target, not multi-user.target: the rig shares the host's network and /var,
# and must not start the host's own services (a second PostgreSQL on the host's data
# directory, say). journald and dbus.socket come with basic.target; the tests start
# the rest themselves.
exec /lib/systemd/systemd --unit=basic.target
