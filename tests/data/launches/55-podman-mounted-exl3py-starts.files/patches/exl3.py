# A stand-in for a patched exl3.py of the fork (written for exl3tool's tests): only the part exl3tool reads, the
# online method's rule for a shard neither 128-aligned nor a multiple of 32 wide, in the form of the fork's PR #312.


class UnquantizedLinearMethod:  # stands for vLLM's BF16 linear method
    pass


class Exl3OnlineLinearMethod:
    def create_weights(self, input_size_per_partition: int) -> None:
        if input_size_per_partition % 128:
            self.fallback = UnquantizedLinearMethod()  # kept BF16: no online encode, no cache look-up
