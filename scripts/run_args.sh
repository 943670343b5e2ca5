# Sourced by the GPU run scripts (serving_run.sh, two_gpu_run.sh): their shared command line.
#   parse_run_args NAME DEFAULT_OUT STEPS "$@"
# STEPS (comma-separated) are every step the script knows, the default of --steps. Sets cpu (0 or 1), out (the
# results folder, created, absolute) and steps, or exits 2 naming an unknown argument or step before anything runs.
# A script that starts its own servers sets takes_serve_flags=1 first: --serve-flags "FLAGS" then sets serve_flags
# (an array of extra `hybridkv serve` flags for every server it starts, to compare a setting).
parse_run_args() {
  local name=$1 known=",$3," step
  cpu=0 out=${OUT:-$2} steps=$3 serve_flags=()
  shift 3
  while (($#)); do
    case "$1" in
      --cpu) cpu=1 ;;
      --out) out=$2; shift ;;
      --steps) steps=$2; shift ;;
      --serve-flags)
        if ((${takes_serve_flags:-0})); then read -r -a serve_flags <<<"$2"; shift
        else echo "$name: unknown argument $1 (see the header of this script)" >&2; exit 2; fi ;;
      *) echo "$name: unknown argument $1 (see the header of this script)" >&2; exit 2 ;;
    esac
    shift
  done
  for step in ${steps//,/ }; do
    if [[ $known != *",$step,"* ]]; then
      echo "$name: unknown step $step ($(echo "${known:1:-1}" | sed 's/,/, /g'))" >&2
      exit 2
    fi
  done
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
}
