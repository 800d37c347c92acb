#!/usr/bin/env bash
# The two-host test of data-parallel training (issue 35): two network namespaces joined by
# a veth pair act as two hosts, each with its own hostname, /dev/shm and address; Open MPI
# launches one rank on each (its rsh launcher, with `ip netns exec` as the remote shell),
# pinned to TCP. The tiny GPT trained by the two "hosts" (per-device batch 4) must give the
# losses of one process with batch 8 within 1e-6, and the weights of one process
# accumulating 2 microbatches of 4 bit for bit. Sets up and tears down everything it makes.
# Usage: tools/two_host_test.sh [BUILD_DIR]   (root: namespaces and mounts)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
KILN=$(realpath "$BUILD/bin/kiln")
fail() { echo "two_host_test: FAIL: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || fail "needs root (ip netns, mount); run as root"
for c in ip unshare mpirun /usr/bin/python3; do command -v "$c" >/dev/null || fail "$c is missing (tools/install_deps.sh)"; done
[ -f data/text/train.bin ] || fail "data/text/train.bin is missing: run tools/prepare_test_data.sh"

tag=$$
H1=kh1-$tag H2=kh2-$tag
WORK=$(mktemp -d /tmp/kiln_two_host.XXXXXX)
cleanup() {
  ip netns del "$H1" 2>/dev/null || true
  ip netns del "$H2" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

# Two "hosts": namespaces, a veth pair between them, 10.213.0.1 and 10.213.0.2.
ip netns add "$H1"
ip netns add "$H2"
ip link add "kv1_$tag" type veth peer name "kv2_$tag"
ip link set "kv1_$tag" netns "$H1"
ip link set "kv2_$tag" netns "$H2"
ip -n "$H1" addr add 10.213.0.1/24 dev "kv1_$tag"
ip -n "$H2" addr add 10.213.0.2/24 dev "kv2_$tag"
for h in "$H1" "$H2"; do
  ip -n "$h" link set lo up
done
ip -n "$H1" link set "kv1_$tag" up
ip -n "$H2" link set "kv2_$tag" up
printf '127.0.0.1 localhost\n10.213.0.1 %s\n10.213.0.2 %s\n' "$H1" "$H2" > "$WORK/hosts"
printf '%s slots=1\n%s slots=1\n' "$H1" "$H2" > "$WORK/hostfile"
# Open MPI's launch agent: called as AGENT HOST COMMAND (the command as one shell string).
cat > "$WORK/agent.sh" <<AGENT
#!/bin/bash
host=\$1; shift
exec ip netns exec "\$host" unshare --uts --mount sh -c "hostname \$host; mount -t tmpfs tmpfs /dev/shm; mount --bind $WORK/hosts /etc/hosts; \$*"
AGENT
chmod +x "$WORK/agent.sh"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
MPI="mpirun --hostfile $WORK/hostfile -np 2 --mca plm_rsh_agent $WORK/agent.sh --mca btl tcp,self \
  --mca oob_tcp_if_include 10.213.0.0/24 --mca btl_tcp_if_include 10.213.0.0/24 -x OMP_NUM_THREADS"
# Run a command on host 1: its network namespace, its own hostname (UTS), /dev/shm and /etc/hosts.
on_h1() { ip netns exec "$H1" unshare --uts --mount sh -c "hostname $H1; mount -t tmpfs tmpfs /dev/shm; mount --bind $WORK/hosts /etc/hosts; $1"; }

hosts=$(on_h1 "$MPI hostname" | sort | tr '\n' ' ')
[ "$hosts" = "$H1 $H2 " ] || fail "the ranks did not run on the two hosts (got: $hosts)"

ARGS="train examples/tiny_gpt/model.onnx --train_data data/text/train.bin --block_size 64 --max_steps 10 \
  --logging_steps 1 --learning_rate 3e-3 --weight_decay 0.01 --disable_dropout --disable_tqdm --seed 7 \
  --cache_dir $WORK/cache"
on_h1 "cd $PWD && $MPI $KILN $ARGS --per_device_train_batch_size 4 --output_dir $WORK/hosts2" > "$WORK/two.log" 2>&1 ||
  { cat "$WORK/two.log"; fail "the two-host run failed"; }
grep -q "data parallel: 2 ranks" "$WORK/two.log" || { cat "$WORK/two.log"; fail "no data-parallel summary"; }
"$KILN" $ARGS --per_device_train_batch_size 8 --output_dir "$WORK/one" > "$WORK/one.log" 2>&1 ||
  { cat "$WORK/one.log"; fail "the one-process run failed"; }
"$KILN" $ARGS --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --output_dir "$WORK/accum" \
  > "$WORK/accum.log" 2>&1 || { cat "$WORK/accum.log"; fail "the accumulation run failed"; }

/usr/bin/python3 - "$WORK" <<'PY'
import json, sys
work = sys.argv[1]
def losses(d):
    out = {}
    for line in open(f"{work}/{d}/metrics.jsonl"):
        j = json.loads(line)
        if "loss" in j:
            out[j["step"]] = j["loss"]
    return out
two, one = losses("hosts2"), losses("one")
assert len(two) == 10 and two.keys() == one.keys(), (two, one)
worst = max(abs(two[s] - one[s]) / abs(one[s]) for s in one)
print(f"two_host_test: 10 losses of 2 hosts vs 1 process (batch 8): max relative difference {worst:.2e}")
assert worst <= 1e-6, "losses differ by more than 1e-6"
PY
cmp -s "$WORK/hosts2/model.safetensors" "$WORK/accum/model.safetensors" ||
  fail "the weights of 2 hosts differ from one process accumulating 2 microbatches"
echo "two_host_test: ok (ranks on ${hosts% } over TCP; weights equal to 1 process x 2 microbatches bit for bit)"
