# Sourced by examples/demo, .ci/run and tools/install-deps (bash): under sudo, use
# the Rust toolchain of the user who ran sudo when root has no cargo on its PATH.
#
# `sudo .ci/run` loses ~/.cargo/bin (sudo's secure_path), and rustup's proxies look
# for their toolchains in $HOME/.rustup, which sudo makes root's. So, when root has
# no cargo and $SUDO_USER's home has ~/.cargo/bin/cargo, that directory goes first
# on PATH and RUSTUP_HOME is set to $SUDO_USER's ~/.rustup (read: the toolchains).
# CARGO_HOME stays root's: the crates root downloads stay out of the user's home.
if ! command -v cargo >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
   && [ -n "${SUDO_USER:-}" ] && [ "$SUDO_USER" != root ]; then
  _sg_home=$(getent passwd "$SUDO_USER" | cut -d: -f6)
  if [ -n "$_sg_home" ] && [ -x "$_sg_home/.cargo/bin/cargo" ]; then
    export PATH="$_sg_home/.cargo/bin:$PATH"
    if [ -z "${RUSTUP_HOME:-}" ] && [ -d "$_sg_home/.rustup" ]; then
      export RUSTUP_HOME="$_sg_home/.rustup"
    fi
    echo "$(basename "$0"): using $SUDO_USER's Rust toolchain ($_sg_home/.cargo/bin${RUSTUP_HOME:+, RUSTUP_HOME=$RUSTUP_HOME})" >&2
  fi
  unset _sg_home
fi
