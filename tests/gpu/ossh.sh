#!/bin/sh
# OpenSSH on a GPU machine that has none, from Debian's .deb files carried there (docs/real-gpu.md):
#   sh tests/gpu/ossh.sh DEB_DIR PORT STATE_DIR
# unpacks the packages into STATE_DIR/root, makes host and client keys, starts sshd on
# 127.0.0.1:PORT (root login by key only) and writes STATE_DIR/sshd.pid, STATE_DIR/env (source it
# for PATH/LD_LIBRARY_PATH of ssh and sshd) and STATE_DIR/id_ed25519. Stop it with
# `kill $(cat STATE_DIR/sshd.pid)`: the PID this script recorded, nothing else.
set -eu
debs=$1; port=$2; state=$3
mkdir -p "$state/root"
for d in "$debs"/*.deb; do dpkg -x "$d" "$state/root"; done
root=$state/root
cat > "$state/env" <<ENV
export LD_LIBRARY_PATH=$root/usr/lib/x86_64-linux-gnu:$root/lib/x86_64-linux-gnu\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
export PATH=$root/usr/bin:$root/usr/sbin:\$PATH
ENV
. "$state/env"
id sshd >/dev/null 2>&1 || useradd -r -d /run/sshd -s /usr/sbin/nologin sshd
mkdir -p /run/sshd && chmod 755 /run/sshd
[ -f "$state/host_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -f "$state/host_ed25519"
[ -f "$state/id_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -f "$state/id_ed25519"
cp "$state/id_ed25519.pub" "$state/authorized_keys"  # root login by this key only
cat > "$state/sshd_config" <<CFG
Port $port
ListenAddress 127.0.0.1
HostKey $state/host_ed25519
PidFile $state/sshd.pid
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
AuthorizedKeysFile $state/authorized_keys
Subsystem sftp $root/usr/lib/openssh/sftp-server
CFG
"$root/usr/sbin/sshd" -f "$state/sshd_config"
for _ in 1 2 3 4 5 6 7 8 9 10; do [ -s "$state/sshd.pid" ] && break; sleep 0.2; done
ssh -i "$state/id_ed25519" -p "$port" -o StrictHostKeyChecking=accept-new \
    -o UserKnownHostsFile="$state/known_hosts" -o BatchMode=yes root@127.0.0.1 true
echo "sshd pid $(cat "$state/sshd.pid") on 127.0.0.1:$port"
