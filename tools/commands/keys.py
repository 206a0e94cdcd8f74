"""`poseidon keys FILE`: a job's CURVE key pair, for the --keys flag of a multi-host job."""
from .common import out


def add(sub):
    p = sub.add_parser("keys", help="make the key file of a multi-host job (--keys FILE)")
    p.add_argument("file", help="the key file to write (created with mode 0600)")
    p.add_argument("--force", action="store_true", help="replace an existing file")
    p.set_defaults(run=run)


def run(args):
    from poseidon.dist.job.security import write_key_file
    keys = write_key_file(args.file, overwrite=args.force)
    out(f"Wrote {args.file} (mode 0600; public key {keys.public.decode()}). Copy it to every host "
        f"of the job (or a shared job folder readable only by you) and give every process "
        f"--keys {args.file}.")
