//! [`FineClass`]: the name of an item class (`loans.fine_class`, `fine_policies.fine_class`), parsed once.

use std::fmt;

/// The class a loan falls back to when it has none, or when its class has no policy for its due date.
pub const DEFAULT_CLASS: &str = "default";

/// The longest class name, in characters (the table's check says the same).
pub const MAX_CLASS_CHARS: usize = 64;

/// A class name of 1 to [`MAX_CLASS_CHARS`] characters.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FineClass(String);

/// Why a class name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClassError {
    /// The name is empty.
    #[error("must not be empty")]
    Empty,
    /// The name is longer than [`MAX_CLASS_CHARS`] characters.
    #[error("must be at most {MAX_CLASS_CHARS} characters, got {0}")]
    TooLong(usize),
}

impl FineClass {
    /// The `default` class.
    pub fn default_class() -> Self {
        FineClass(DEFAULT_CLASS.to_string())
    }

    /// A class name, or why it is not one.
    pub fn new(name: &str) -> Result<Self, ClassError> {
        match name.chars().count() {
            0 => Err(ClassError::Empty),
            n if n > MAX_CLASS_CHARS => Err(ClassError::TooLong(n)),
            _ => Ok(FineClass(name.to_string())),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for FineClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_one_to_sixty_four_characters() {
        assert_eq!(FineClass::new(""), Err(ClassError::Empty));
        assert!(FineClass::new("laptop").is_ok());
        assert!(FineClass::new(&"é".repeat(64)).is_ok());
        assert_eq!(FineClass::new(&"x".repeat(65)), Err(ClassError::TooLong(65)));
        assert_eq!(FineClass::default_class().as_str(), "default");
    }
}
