"""`python -m tokenserve.kernels`: build the C kernels ahead of time (scripts/install.sh)."""

from tokenserve.kernels.build import KERNELS, KernelBuildError, build

if __name__ == "__main__":
    for name in KERNELS:
        try:
            print(f"Built {build(name)}")
        except KernelBuildError as error:
            print(f"C kernel {name!r} not built ({error}); tokenserve will use pure-torch code.")
