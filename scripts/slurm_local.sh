#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, to try `srun` launches (and for the tests' srun cases):
# installs Debian's slurm-wlm when missing, writes /etc/slurm/slurm.conf for this host, starts munged,
# slurmctld and slurmd, and waits until the node is idle. Needs root and apt; does nothing when a Slurm
# cluster already answers. Then, for example:
#   srun -n 8 --mpi=pmix --export=ALL,OMP_NUM_THREADS=1 ./train_gpt_cpu --tp 2 --pp 2
# The node claims at least 8 CPUs (config_overrides) so that 8 ranks fit on a small machine.
set -u
if command -v sinfo > /dev/null 2>&1 && timeout 10 sinfo -h -o %t 2> /dev/null | grep -qE "idle|mix|alloc"; then
    echo "slurm: a cluster already answers"
    exit 0
fi
[ "$(id -u)" = 0 ] || { echo "slurm_local.sh: needs root (it writes /etc/slurm and starts daemons)"; exit 1; }
if ! command -v slurmd > /dev/null 2>&1; then
    echo "installing Slurm ..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq slurm-wlm > /dev/null || { echo "slurm_local.sh: could not install slurm-wlm"; exit 1; }
fi
host=$(hostname -s)
cpus=$(nproc)
[ "$cpus" -ge 8 ] || cpus=8
mkdir -p /etc/slurm /var/spool/slurmd /var/spool/slurmctld_llmpar /var/log/slurm /run/munge
cat > /etc/slurm/slurm.conf << EOF
ClusterName=llmpar
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
StateSaveLocation=/var/spool/slurmctld_llmpar
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ReturnToService=2
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
chown -R munge:munge /run/munge /etc/munge 2> /dev/null
running() { pgrep -x -r R,S,D "$1" > /dev/null; }  # not counting a killed daemon's unreaped zombie
running munged || munged --force 2> /dev/null
running slurmctld || slurmctld -c  # -c: forget jobs saved by an earlier run of this script
running slurmd || slurmd
for i in $(seq 30); do
    if timeout 5 sinfo -h -o %t 2> /dev/null | grep -q idle; then
        echo "slurm: one-node cluster up ($host, $cpus CPUs)"
        exit 0
    fi
    running slurmctld && running slurmd || break
    sleep 1
done
echo "slurm_local.sh: the node did not come up; the logs in /var/log/slurm/ end:"
tail -n 3 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log
exit 1
