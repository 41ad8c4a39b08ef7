//! An f32 operand of a matrix product as the CPU's kernels read it (`matmul`'s chunks of `gemm`
//! and `fma_gemm`'s panels): where it starts and how far apart its rows and columns lie.

/// An f32 operand as the product kernels read it: its first element and its (row, column)
/// strides in elements.
#[derive(Clone, Copy)]
pub(crate) struct Strided {
    /// The element at row 0, column 0.
    pub ptr: *const f32,
    /// Elements from one row to the next.
    pub row_stride: isize,
    /// Elements from one column to the next.
    pub col_stride: isize,
}

// SAFETY: an operand is only read, and only while the product that holds it runs.
unsafe impl Send for Strided {}
// SAFETY: as above.
unsafe impl Sync for Strided {}

impl Strided {
    /// `data` read through `(row stride, column stride)`.
    pub(crate) fn new(data: &[f32], (row_stride, col_stride): (isize, isize)) -> Self {
        Strided {
            ptr: data.as_ptr(),
            row_stride,
            col_stride,
        }
    }

    /// The operand from row `row`, column `col` on (the pointer moved, not read).
    pub(crate) fn from(self, row: usize, col: usize) -> Self {
        let offset = row as isize * self.row_stride + col as isize * self.col_stride;
        Strided {
            ptr: self.ptr.wrapping_offset(offset),
            ..self
        }
    }
}
