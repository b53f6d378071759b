//! `torch.dtype` names and element sizes.

use bincode::{Decode, Encode};

macro_rules! dtypes {
    ($($variant:ident = $name:literal, $bits:literal;)*) => {
        /// A tensor element type, named as `torch` prints it without the `torch.` prefix.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Encode, Decode)]
        pub enum Dtype { $($variant,)* }

        impl Dtype {
            /// Every dtype the format knows, in declaration order.
            pub const ALL: &'static [Dtype] = &[$(Dtype::$variant,)*];

            pub fn name(self) -> &'static str {
                match self { $(Dtype::$variant => $name,)* }
            }

            /// Parses a dtype name; `None` for names the format does not define.
            pub fn from_name(name: &str) -> Option<Dtype> {
                match name { $($name => Some(Dtype::$variant),)* _ => None }
            }

            /// Storage bits per element (sub-byte types round up when sizing tensors).
            pub fn bits(self) -> u32 {
                match self { $(Dtype::$variant => $bits,)* }
            }
        }
    };
}

dtypes! {
    Float64 = "float64", 64;
    Float32 = "float32", 32;
    Float16 = "float16", 16;
    BFloat16 = "bfloat16", 16;
    Float8E4M3Fn = "float8_e4m3fn", 8;
    Float8E4M3FnUz = "float8_e4m3fnuz", 8;
    Float8E5M2 = "float8_e5m2", 8;
    Float8E5M2FnUz = "float8_e5m2fnuz", 8;
    Float8E8M0FnU = "float8_e8m0fnu", 8;
    Complex128 = "complex128", 128;
    Complex64 = "complex64", 64;
    Complex32 = "complex32", 32;
    Int64 = "int64", 64;
    Int32 = "int32", 32;
    Int16 = "int16", 16;
    Int8 = "int8", 8;
    UInt64 = "uint64", 64;
    UInt32 = "uint32", 32;
    UInt16 = "uint16", 16;
    UInt8 = "uint8", 8;
    Bool = "bool", 8;
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        u64::from(self.bits().div_ceil(8))
    }

    pub fn is_floating(self) -> bool {
        matches!(
            self,
            Dtype::Float64
                | Dtype::Float32
                | Dtype::Float16
                | Dtype::BFloat16
                | Dtype::Float8E4M3Fn
                | Dtype::Float8E4M3FnUz
                | Dtype::Float8E5M2
                | Dtype::Float8E5M2FnUz
                | Dtype::Float8E8M0FnU
        )
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sizes_are_torchs() {
        for &d in Dtype::ALL {
            assert_eq!(Dtype::from_name(d.name()), Some(d));
        }
        assert_eq!(Dtype::BFloat16.size(), 2);
        assert_eq!(Dtype::Float32.size(), 4);
        assert_eq!(Dtype::Bool.size(), 1);
        assert_eq!(Dtype::Complex64.size(), 8);
        assert_eq!(Dtype::from_name("torch.float32"), None);
    }
}
