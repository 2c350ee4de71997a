#!/bin/bash
# The baseline: a plain sequential ssh loop, one host after another (as the seed runbooks did).
# Usage: ssh_loop.sh HOSTS_TSV KEY KNOWN_HOSTS CONNECT_TIMEOUT SCRIPT_FILE
# HOSTS_TSV lines: name address port. Each host's output goes to stdout after a header line.
hosts=$1 key=$2 known=$3 ct=$4 script=$(cat "$5")
rc=0
while read -r name addr port; do
  echo "=== $name"
  ssh -n -F /dev/null -i "$key" -o IdentitiesOnly=yes -o BatchMode=yes \
      -o UserKnownHostsFile="$known" -o GlobalKnownHostsFile=/dev/null \
      -o StrictHostKeyChecking=yes -o ConnectTimeout="$ct" -o LogLevel=ERROR \
      -p "$port" -l root "$addr" "$script" || rc=1
done < "$hosts"
exit $rc
