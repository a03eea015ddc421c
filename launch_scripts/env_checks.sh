# Sourced by the launch scripts (not run): the checks of the values they take from the environment.
#
# Each value is matched against a pattern before any use and never evaluated. Bash arithmetic
# ($((...)), ((...)), [[ ... -eq ... ]], array subscripts) evaluates a variable's text as an
# expression, command substitutions in subscripts included: MASTER_PORT='x[$(cmd)]' in
# $((MASTER_PORT + 1)) runs cmd. So only a checked integer ever reaches arithmetic, and no value
# reaches eval or a `python -c` program text. A bad value is one line and exit 2, before anything
# runs.

bad() {
    echo "error: $*" >&2
    exit 2
}

# A value as it reads on one line (a value with control characters, e.g. a newline, quoted).
shown() {
    if [[ "$1" =~ ^[[:print:]]*$ ]]; then
        printf '%s' "$1"
    else
        printf '%q' "$1"
    fi
}

positive_int() { # NAME VALUE
    [[ "$2" =~ ^[1-9][0-9]{0,8}$ ]] || bad "$1=$(shown "$2"): must be a positive integer"
}

port() { # NAME VALUE
    if ! [[ "$2" =~ ^[1-9][0-9]{0,4}$ ]] || (("$2" > 65535)); then
        bad "$1=$(shown "$2"): must be a port number from 1 to 65535"
    fi
}

one_of() { # NAME VALUE CHOICE...
    local name=$1 value=$2 choice
    shift 2
    for choice in "$@"; do
        [[ "${value}" == "${choice}" ]] && return 0
    done
    bad "${name}=$(shown "${value}"): choose one of $*"
}

host() { # NAME VALUE: a host name or an IPv4/IPv6 address
    [[ "$2" =~ ^[A-Za-z0-9:]([A-Za-z0-9._:-]{0,252})$ ]] ||
        bad "$1=$(shown "$2"): must be a host name or an IP address"
}

# MASTER_PORT as given, else derived from SLURM's job id (this shell's pid outside SLURM);
# SLURM_JOB_ID is checked first: it reaches arithmetic.
master_port() {
    if [[ -n "${SLURM_JOB_ID:-}" ]] && ! [[ "${SLURM_JOB_ID}" =~ ^[0-9]{1,18}$ ]]; then
        bad "SLURM_JOB_ID=$(shown "${SLURM_JOB_ID}"): must be a job number (SLURM sets it)"
    fi
    MASTER_PORT=${MASTER_PORT:-$((20000 + 10#${SLURM_JOB_ID:-$$} % 20000))}
    port MASTER_PORT "${MASTER_PORT}"
}
