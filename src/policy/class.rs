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
    /// A new name (`policy add`) begins or ends with white space, or holds a control character: libraryd's
    /// `loans.fine_class` is matched exactly, and no one types such a name on purpose.
    #[error("must not begin or end with white space nor hold a control character (loans.fine_class is matched exactly)")]
    Unusual,
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

    /// A name for a new version ([`FineClass::new`], and no leading or trailing white space, no control
    /// character). Names read from the database are taken as [`FineClass::new`] takes them.
    pub fn new_name(name: &str) -> Result<Self, ClassError> {
        let class = FineClass::new(name)?;
        if name.trim() != name || name.chars().any(char::is_control) {
            return Err(ClassError::Unusual);
        }
        Ok(class)
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

    #[test]
    fn a_new_name_is_one_someone_would_type() {
        assert!(FineClass::new_name("dvd").is_ok());
        assert!(FineClass::new_name("rare books").is_ok());
        for name in ["   ", " dvd", "dvd\t", "a\nb", "a\u{1}b"] {
            assert_eq!(FineClass::new_name(name), Err(ClassError::Unusual), "{name:?}");
            assert!(
                FineClass::new(name).is_ok(),
                "read from the database as it is: {name:?}"
            );
        }
        assert_eq!(FineClass::new_name(""), Err(ClassError::Empty));
    }
}
