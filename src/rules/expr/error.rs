//! The one error of the expression language: a syntax or name error at a byte offset of the
//! expression text (the rule compiler turns the offset into `file:line:col`).

/// A syntax or name error at a byte offset of the expression text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExprError {
    pub offset: usize,
    pub message: String,
}

pub(super) fn err<T>(offset: usize, message: impl Into<String>) -> Result<T, ExprError> {
    Err(ExprError {
        offset,
        message: message.into(),
    })
}
