#!/usr/bin/env bash
# tc_shape.sh: shape one network interface like Tang et al. 2018 (arXiv:1803.06443) Sec. 5 did on each node
# ("we use tc command to change bandwidth and latency").
#
#   tc_shape.sh apply --dev DEV [--rate R] [--delay D] [--jitter J] [--loss P] [--netns NS] [--dry-run]
#   tc_shape.sh clear --dev DEV [--netns NS]
#   tc_shape.sh show  --dev DEV [--netns NS]
#   tc_shape.sh probe
#
# apply   replaces the root qdisc of DEV (egress: what the host sends).
#         With --delay/--jitter/--loss it uses netem (its own `rate` shapes the
#         bandwidth in the same qdisc). Where the kernel has no netem it says so on
#         stderr and shapes the rate alone with tbf (htb where tbf is missing); the
#         delay, jitter and loss are then NOT applied (gossip.train can emulate the
#         latency instead: --emulate-latency MS). With only --rate it uses tbf.
# clear   restores DEV's default qdisc; clearing a clean interface is fine.
# show    prints DEV's qdiscs with their counters.
# probe   tests, in a throw-away network namespace, which qdiscs this kernel has
#         and prints one line: "netem=yes|no tbf=yes|no htb=yes|no".
#
# Values: rates are a number and bit, kbit, mbit or gbit (5mbit, 1.4gbit; 1 kbit =
# 1000 bit/s as in tc); times are a number and us, ms or s (20ms, 0.13ms); loss is a
# percentage (0.1 or 0.1%). --netns NS runs tc inside network namespace NS.
# --dry-run prints the tc commands (netem path) without running them or needing rights.
#
# Exit status: 0 done; 2 bad usage or value; 3 missing tc or rights; 4 only
# delay/jitter/loss asked for and netem is missing, so nothing was applied; 1 tc failed.
set -u
PROG=tc_shape.sh

die() { # die STATUS MESSAGE: one line on stderr, no trace
    printf '%s: %s\n' "$PROG" "$2" >&2
    exit "$1"
}

usage() {
    cat <<'EOF'
usage: tc_shape.sh apply --dev DEV [--rate R] [--delay D] [--jitter J] [--loss P] [--netns NS] [--dry-run]
       tc_shape.sh clear --dev DEV [--netns NS]
       tc_shape.sh show  --dev DEV [--netns NS]
       tc_shape.sh probe
  R: 5mbit, 1.4gbit, 200kbit (bit, kbit, mbit, gbit)   D, J: 20ms, 0.13ms, 130us, 1s   P: 0.1 or 0.1%
EOF
}

# ---------------------------------------------------------------- value parsing
# decimal NUMBER SCALE: NUMBER * SCALE as an integer (truncated); NUMBER is N or N.F
decimal() {
    local int=${1%%.*} frac="" scale=$2
    [[ $1 == *.* ]] && frac=${1#*.}
    local value=$((10#$int * scale))
    if [[ -n $frac ]]; then
        frac=${frac:0:9}
        local div=1 i
        for ((i = 0; i < ${#frac}; i++)); do div=$((div * 10)); done
        value=$((value + 10#$frac * scale / div))
    fi
    printf '%s' "$value"
}

# parse_rate VALUE -> bits per second on stdout
parse_rate() {
    local v=${1,,}
    if [[ $v =~ ^([0-9]+(\.[0-9]+)?)(bit|kbit|mbit|gbit)$ ]]; then
        local num=${BASH_REMATCH[1]} scale
        case ${BASH_REMATCH[3]} in
            bit) scale=1 ;; kbit) scale=1000 ;; mbit) scale=1000000 ;; gbit) scale=1000000000 ;;
        esac
        local bps
        bps=$(decimal "$num" "$scale")
        if ((bps >= 8)); then
            printf '%s' "$bps"
            return 0
        fi
    fi
    die 2 "bad --rate '$1': expected a positive number and a unit bit, kbit, mbit or gbit (e.g. 5mbit, 1.4gbit, 200kbit)"
}

# parse_time FLAG VALUE -> microseconds on stdout
parse_time() {
    local v=${2,,}
    if [[ $v =~ ^([0-9]+(\.[0-9]+)?)(us|ms|s)$ ]]; then
        local num=${BASH_REMATCH[1]} scale
        case ${BASH_REMATCH[3]} in
            us) scale=1 ;; ms) scale=1000 ;; s) scale=1000000 ;;
        esac
        decimal "$num" "$scale"
        return 0
    fi
    die 2 "bad $1 '$2': expected a non-negative number and a unit us, ms or s (e.g. 20ms, 0.13ms, 130us)"
}

# parse_loss VALUE -> the percentage, validated, on stdout
parse_loss() {
    local v=${1%\%}
    if [[ $v =~ ^[0-9]+(\.[0-9]+)?$ ]] && (($(decimal "$v" 1000000) <= 100000000)); then
        printf '%s' "$v"
        return 0
    fi
    die 2 "bad --loss '$1': expected a percentage from 0 to 100 (e.g. 0.1 or 0.1%)"
}

# ---------------------------------------------------------------- rights
has_cap() { # has_cap BIT: is capability BIT in this shell's effective set?
    local line eff=""
    while read -r line; do
        [[ $line == CapEff:* ]] && eff=${line#CapEff:} && break
    done </proc/$$/status 2>/dev/null
    eff=${eff//[[:space:]]/}
    [[ -n $eff ]] || return 1
    (((16#$eff >> $1) & 1))
}

check_rights() { # check_rights NEEDS_NETNS
    command -v tc >/dev/null 2>&1 ||
        die 3 "tc not found in PATH; install iproute2 (it provides tc and ip)"
    command -v ip >/dev/null 2>&1 ||
        die 3 "ip not found in PATH; install iproute2 (it provides tc and ip)"
    if [[ $ACTION != show ]]; then
        has_cap 12 ||
            die 3 "needs root or CAP_NET_ADMIN to change qdiscs (running as uid $EUID without it); re-run with sudo"
    fi
    if [[ $1 == 1 ]] || [[ $ACTION == probe ]]; then
        has_cap 21 ||
            die 3 "needs CAP_SYS_ADMIN to enter or create network namespaces (--netns, probe); re-run with sudo"
    fi
}

# ---------------------------------------------------------------- tc helpers
TC=(tc)
IPC=(ip)
run_tc() { # run_tc ARGS...: run tc (in the namespace), tc's own error kept in TC_ERR
    if [[ $DRY_RUN == 1 ]]; then
        printf '+ %s\n' "${TC[*]} $*"
        return 0
    fi
    TC_ERR=$("${TC[@]}" "$@" 2>&1 >/dev/null)
}

require_dev() {
    [[ $DRY_RUN == 1 ]] && return 0
    if ! "${IPC[@]}" link show dev "$DEV" >/dev/null 2>&1; then
        if [[ -n $NETNS ]]; then
            die 2 "no interface '$DEV' in network namespace '$NETNS' (see: ip -n $NETNS link)"
        fi
        die 2 "no interface '$DEV' (see: ip link)"
    fi
}

clear_root() { # delete the root qdisc; "nothing to delete" is success
    run_tc qdisc del dev "$DEV" root && return 0
    case $TC_ERR in
        *"handle of zero"* | *"No such file"* | *"Invalid handle"* | *"Cannot find specified qdisc"*) return 0 ;;
    esac
    die 1 "could not clear $DEV: $TC_ERR"
}

tbf_args() { # tbf_args BPS: rate, burst and queue limit for tbf
    local Bps=$(($1 / 8))
    local burst=$((Bps / 250)) # 4 ms at full rate
    ((burst < 16384)) && burst=16384
    # 2 s of queue: ranks send whole models in bursts (TCP may put megabytes into the
    # qdisc at once); a short queue drops them and the retransmissions cost more time
    # than the bytes. TCP's window, not this limit, bounds what is really queued.
    local limit=$((Bps * 2))
    ((limit < 4 * burst)) && limit=$((4 * burst))
    ((limit > 67108864)) && limit=67108864
    printf '%s' "rate ${1}bit burst $burst limit $limit"
}

netem_limit() { # packets netem may hold: (delay + jitter + 2 s) at the rate, >= 1000
    local bps=${1:-10000000000} us=$(($2 + $3 + 2000000))
    local pkts=$((bps / 8 * us / 1000000 / 1500 + 1000))
    ((pkts > 1000000)) && pkts=1000000
    printf '%s' "$pkts"
}

human_rate() { # 5000000 -> 5mbit
    local b=$1
    if ((b % 1000000000 == 0)); then printf '%sgbit' $((b / 1000000000))
    elif ((b % 1000000 == 0)); then printf '%smbit' $((b / 1000000))
    elif ((b % 1000 == 0)); then printf '%skbit' $((b / 1000))
    else printf '%sbit' "$b"; fi
}

# ---------------------------------------------------------------- actions
do_apply() {
    require_dev
    [[ -z $RATE && -z $DELAY && -z $JITTER && -z $LOSS ]] &&
        die 2 "apply needs at least one of --rate, --delay, --jitter, --loss"
    local bps="" dus=0 jus=0
    [[ -n $RATE ]] && bps=$(parse_rate "$RATE")
    [[ -n $DELAY ]] && dus=$(parse_time --delay "$DELAY")
    [[ -n $JITTER ]] && jus=$(parse_time --jitter "$JITTER")
    [[ -n $LOSS ]] && LOSS=$(parse_loss "$LOSS")
    ((jus > 0 && dus == 0)) && die 2 "--jitter $JITTER needs a --delay (netem varies the delay by the jitter)"
    local where="$DEV"
    [[ -n $NETNS ]] && where="$DEV (netns $NETNS)"
    clear_root
    local want_netem=0
    [[ -n $DELAY || -n $JITTER || -n $LOSS ]] && want_netem=1
    if ((want_netem)); then
        local args=(delay "${dus}us")
        ((jus > 0)) && args+=("${jus}us" distribution normal)
        [[ -n $LOSS ]] && args+=(loss "${LOSS}%")
        [[ -n $bps ]] && args+=(rate "${bps}bit")
        args+=(limit "$(netem_limit "$bps" "$dus" "$jus")")
        if run_tc qdisc add dev "$DEV" root handle 1: netem "${args[@]}"; then
            [[ $DRY_RUN == 1 ]] || echo "$PROG: $where: netem ${args[*]}"
            return 0
        fi
        case $TC_ERR in
            *"qdisc kind is unknown"* | *"Unknown qdisc"* | *"No such file or directory"*) ;;
            *) die 1 "tc refused netem on $where: $TC_ERR" ;;
        esac
        if [[ -z $bps ]]; then
            die 4 "netem is not available on this kernel (no sch_netem): cannot apply --delay/--jitter/--loss on $where and no --rate was given; nothing applied"
        fi
        echo "$PROG: netem is not available on this kernel (no sch_netem): shaping only the rate ($(human_rate "$bps")) with tbf on $where; --delay/--jitter/--loss NOT applied (emulate latency in the communicator: --emulate-latency MS)" >&2
    fi
    # shellcheck disable=SC2046
    if run_tc qdisc add dev "$DEV" root handle 1: tbf $(tbf_args "$bps"); then
        [[ $DRY_RUN == 1 ]] || echo "$PROG: $where: tbf $(tbf_args "$bps")"
        return 0
    fi
    case $TC_ERR in
        *"qdisc kind is unknown"* | *"Unknown qdisc"*) ;;
        *) die 1 "tc refused tbf on $where: $TC_ERR" ;;
    esac
    echo "$PROG: tbf is not available on this kernel: shaping the rate with htb on $where" >&2
    local burst=$(($bps / 8 / 250))
    ((burst < 16384)) && burst=16384
    run_tc qdisc add dev "$DEV" root handle 1: htb default 1 || die 1 "tc refused htb on $where: $TC_ERR"
    run_tc class add dev "$DEV" parent 1: classid 1:1 htb rate "${bps}bit" ceil "${bps}bit" burst "$burst" cburst "$burst" ||
        { clear_root; die 1 "tc refused the htb class on $where: $TC_ERR"; }
    [[ $DRY_RUN == 1 ]] || echo "$PROG: $where: htb rate ${bps}bit"
}

do_clear() {
    require_dev
    clear_root
    [[ $DRY_RUN == 1 ]] || echo "$PROG: ${DEV}${NETNS:+ (netns $NETNS)}: default qdisc restored"
}

do_show() {
    require_dev
    "${TC[@]}" -s qdisc show dev "$DEV" || die 1 "tc could not show $DEV"
}

do_probe() {
    local ns="tcshape-probe-$$-$RANDOM"
    ip netns add "$ns" 2>/dev/null || die 1 "probe: could not create a network namespace to test in"
    # shellcheck disable=SC2064
    trap "ip netns del '$ns' >/dev/null 2>&1" EXIT
    ip -n "$ns" link set lo up >/dev/null 2>&1
    local out=() kind
    for kind in netem tbf htb; do
        local args=()
        case $kind in
            netem) args=(netem delay 1ms) ;;
            tbf) args=(tbf rate 1mbit burst 16384 limit 65536) ;;
            htb) args=(htb default 1) ;;
        esac
        if tc -n "$ns" qdisc add dev lo root "${args[@]}" >/dev/null 2>&1; then
            out+=("$kind=yes")
            tc -n "$ns" qdisc del dev lo root >/dev/null 2>&1
        else
            out+=("$kind=no")
        fi
    done
    echo "${out[*]}"
}

# ---------------------------------------------------------------- main
ACTION=${1:-}
case $ACTION in
    apply | clear | show | probe) shift ;;
    -h | --help | help) usage; exit 0 ;;
    "") usage >&2; die 2 "missing action: apply, clear, show or probe" ;;
    *) usage >&2; die 2 "unknown action '$ACTION': expected apply, clear, show or probe" ;;
esac

DEV="" NETNS="" RATE="" DELAY="" JITTER="" LOSS="" DRY_RUN=0 TC_ERR=""
while (($#)); do
    opt=$1
    case $opt in
        --dry-run) DRY_RUN=1; shift; continue ;;
        -h | --help) usage; exit 0 ;;
        --dev | --netns | --rate | --delay | --jitter | --loss)
            (($# >= 2)) || die 2 "$opt needs a value"
            val=$2
            shift 2
            ;;
        --dev=* | --netns=* | --rate=* | --delay=* | --jitter=* | --loss=*)
            val=${opt#*=}
            opt=${opt%%=*}
            shift
            ;;
        *) die 2 "unknown option '$opt' (see: $PROG --help)" ;;
    esac
    case $opt in
        --dev) DEV=$val ;;
        --netns) NETNS=$val ;;
        --rate) RATE=$val ;;
        --delay) DELAY=$val ;;
        --jitter) JITTER=$val ;;
        --loss) LOSS=$val ;;
    esac
done

if [[ $ACTION != probe ]]; then
    [[ -n $DEV ]] || die 2 "$ACTION needs --dev DEV (the interface to shape, e.g. eth0)"
    [[ $DEV =~ ^[A-Za-z0-9_.:@-]{1,15}$ ]] || die 2 "bad --dev '$DEV': not an interface name"
fi
if [[ -n $NETNS ]]; then
    [[ $NETNS =~ ^[A-Za-z0-9_.-]{1,64}$ ]] || die 2 "bad --netns '$NETNS': not a namespace name"
    TC=(tc -n "$NETNS")
    IPC=(ip -n "$NETNS")
fi
# validate the values before asking for rights, so a typo is named first
[[ -n $RATE ]] && { parse_rate "$RATE" >/dev/null || exit 2; }
[[ -n $DELAY ]] && { parse_time --delay "$DELAY" >/dev/null || exit 2; }
[[ -n $JITTER ]] && { parse_time --jitter "$JITTER" >/dev/null || exit 2; }
[[ -n $LOSS ]] && { parse_loss "$LOSS" >/dev/null || exit 2; }

if [[ $DRY_RUN == 0 ]]; then
    check_rights "$([[ -n $NETNS ]] && echo 1 || echo 0)"
fi

case $ACTION in
    apply) do_apply ;;
    clear) do_clear ;;
    show) do_show ;;
    probe) do_probe ;;
esac
